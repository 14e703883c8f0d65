"""The benchmark client's own clock (benchmarks/client_clock.py): its stalls are recorded and told apart
(its own work vs not scheduled at all), and its priority is applied only where asked and put back."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvtier.benchmarks.client_clock import StallWatch, client_priority


def test_a_stall_of_the_process_own_work_is_recorded_with_its_cpu():
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1.0)   # the busy loop below keeps the GIL from the watch thread until it sleeps
    try:
        with StallWatch(min_lag_s=0.05) as watch:
            time.sleep(0.05)
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                pass
            time.sleep(0.05)
    finally:
        sys.setswitchinterval(switch)
    s = watch.summary()
    assert s["stalls"] >= 1 and s["max_ms"] >= 200, s
    assert s["descheduled_ms"] < s["max_ms"], s   # the process was running: its own work, not descheduling


CHILD = """
import json, sys, time
from kvtier.benchmarks.client_clock import StallWatch
with StallWatch(min_lag_s=0.05) as w:
    print("ready", flush=True)
    time.sleep(1.5)
print(json.dumps(w.summary()), flush=True)
"""


def test_a_descheduled_process_is_recorded_as_such():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.kill(child.pid, signal.SIGSTOP)   # the kernel runs none of it for 0.4 s
    time.sleep(0.4)
    os.kill(child.pid, signal.SIGCONT)
    out, _ = child.communicate(timeout=30)
    s = json.loads(out.strip().splitlines()[-1])
    assert s["max_ms"] >= 350 and s["descheduled_ms"] >= 350, s


def test_client_priority_sets_the_autogroup_and_restores_it(tmp_path):
    group, switch = tmp_path / "autogroup", tmp_path / "switch"
    group.write_text("/autogroup-7 nice 0\n")
    switch.write_text("1\n")
    with client_priority(-10, autogroup=group, switch=switch) as how:
        assert how == "autogroup nice -10" and group.read_text() == "-10"
    assert group.read_text() == "0"
    with client_priority(None, autogroup=group, switch=switch) as how:   # not asked: nothing touched
        assert how is None and group.read_text() == "0"


def test_client_priority_without_autogroup_is_the_thread_nice_or_refused_by_name(tmp_path):
    switch = tmp_path / "switch"
    switch.write_text("0\n")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError, match="--client-nice -5"):
            with client_priority(-5, switch=switch):
                pass
    else:
        with client_priority(-5, switch=switch) as how:
            assert how == "thread nice -5" and os.getpriority(os.PRIO_PROCESS, 0) == -5
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.parametrize("nice", [1, 19, -21])
def test_client_priority_refuses_values_that_would_not_be_restorable_or_are_invalid(nice):
    with pytest.raises(ValueError, match=f"--client-nice {nice}"):
        with client_priority(nice):
            pass


@pytest.mark.parametrize("argv", [["serve", "--arms", "stock", "--workloads", "idle"],
                                  ["goodput", "--arms", "stock", "--problems", "1"]])
def test_bench_refuses_a_bad_client_nice_before_any_server_starts(tmp_path, argv):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["bench", *argv, "--client-nice", "5", "--workdir", str(tmp_path / "work")])
    assert r.exit_code == 2 and "--client-nice" in r.output, r.output
    assert not (tmp_path / "work").exists()
