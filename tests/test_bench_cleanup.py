"""A benchmark stopped by SIGTERM (as `timeout`, CI runners and Kubernetes stop it) stops what it started:
the `kvtier serve` child and that child's whole Ray cluster (issue #27 item 3: one was found running an
hour later, taking CPU from everything measured after it)."""

import os
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("vllm")
pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_bench_goodput_stopped_by_sigterm_leaves_no_process(tmp_path):
    log = tmp_path / "bench.log"
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "goodput", "--problems", "64", "--arms", "full",
           "--concurrency", "8", "--workdir", str(tmp_path / "work")]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while "kvtier: ready" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        time.sleep(3)                                    # requests in flight
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("ray" in " ".join(p.cmdline()) for p in started if p.is_running()), "no Ray cluster seen"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        time.sleep(2)
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
