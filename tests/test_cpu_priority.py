"""service/cpu_priority.py on a real process tree: which processes `kvtier serve`'s keeper lowers.

The tree (children of this test process): a plain process (lowered), a process titled like vLLM's engine
core with a child (neither lowered: the whole subtree is the engine's), one titled like an engine replica
named in `skip` (not lowered), a process started with the engine replica's NICE_ENV whatever its title (not
lowered by the keeper: a replica between titles), an untitled Ray worker (not lowered), and a process named `raylet` with a
child (the raylet kept, since workers inherit its nice value; its child lowered). Each names a Ray
session directory on its command line, as Ray's daemons do, except one more child that is not Ray's (not
lowered when the session is given). This process itself is never touched with include_self=False."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

from kvtier.service.cpu_priority import NICE_ENV, PriorityKeeper, lower_serving_priority, replica_titles  # noqa: E402
from service_helpers import thread_nices  # noqa: E402

SLEEP = "import time; time.sleep(120)"
# (sys.executable is unknown in a process whose argv[0] is a title: the path is spelled out)
SPAWN = f"import subprocess, time; subprocess.Popen([{sys.executable!r}, '-c', {SLEEP!r}]); time.sleep(120)"


def _kill_trees(procs) -> None:
    for p in procs:
        for c in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
            c.kill()
        p.kill()
        p.wait(10)


def test_keeper_lowers_serving_processes_but_never_the_engines_subtree(tmp_path):
    raylet = tmp_path / "raylet"
    raylet.symlink_to(sys.executable)
    engine_replica = replica_titles("kvtier", "engine-cpu")[1]
    session = str(tmp_path / "session_2026-11-30_00-00-00_000000_1")
    specs = {
        "plain": ([sys.executable, "-c", SLEEP], None),
        "engine_core": (["VLLM::EngineCore", "-c", SPAWN], sys.executable),
        "engine_replica": ([engine_replica, "-c", SLEEP], sys.executable),
        "replica_between_titles": ([sys.executable, "-c", SLEEP], None),
        "untitled_worker": (["/x/ray/_private/workers/default_worker.py", "-c", SLEEP], sys.executable),
        "raylet": ([str(raylet), "-c", SPAWN], None),
        "not_ray": ([sys.executable, "-c", SLEEP], None),
    }
    procs = {}
    try:
        for name, (argv, exe) in specs.items():
            env = {**os.environ, NICE_ENV: "10"} if name == "replica_between_titles" else None
            procs[name] = subprocess.Popen(argv + ([] if name == "not_ray" else [f"--session-dir={session}"]),
                                           executable=exe, env=env)
        deadline = time.time() + 30
        while time.time() < deadline and not all(psutil.Process(procs[n].pid).children()
                                                  for n in ("engine_core", "raylet")):
            time.sleep(0.1)
        pids = {n: p.pid for n, p in procs.items()}
        pids["engine_core_child"] = psutil.Process(pids["engine_core"]).children()[0].pid
        pids["raylet_child"] = psutil.Process(pids["raylet"]).children()[0].pid
        assert psutil.Process(pids["raylet"]).name() == "raylet"
        before = os.getpriority(os.PRIO_PROCESS, 0)

        changed = lower_serving_priority(10, include_self=False, skip=(engine_replica,), marker=session,
                                         skip_env=NICE_ENV)

        got = {n: thread_nices(psutil.Process(pid)) for n, pid in pids.items()}
        assert got == {"plain": {10}, "engine_core": {0}, "engine_core_child": {0}, "engine_replica": {0},
                       "replica_between_titles": {0}, "untitled_worker": {0}, "raylet": {0}, "raylet_child": {10},
                       "not_ray": {0}}, got
        assert changed == len(psutil.Process(pids["plain"]).threads()) + len(psutil.Process(pids["raylet_child"]).threads())
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
        assert lower_serving_priority(10, include_self=False, skip=(engine_replica,), marker=session,
                                      skip_env=NICE_ENV) == 0
        lower_serving_priority(10, include_self=False, skip=(engine_replica,))   # no session given: every child
        assert thread_nices(psutil.Process(pids["not_ray"])) == {10}
        assert thread_nices(psutil.Process(pids["replica_between_titles"])) == {10}   # no skip_env: by title only
    finally:
        _kill_trees(procs.values())


@pytest.mark.parametrize("router_nice", [0, 5])
def test_keeper_gives_the_router_its_own_nice_value(tmp_path, router_nice):
    """`server.router_nice`: the router replica's subtree gets its own value (0: left as it is), every other
    serving process the keeper's, the engine replica none."""
    session = str(tmp_path / "session_2026-12-02_00-00-00_000000_1")
    router = replica_titles("kvtier", "KVTierRouter")[1]
    specs = {"proxy": [sys.executable, "-c", SLEEP], "router": [router, "-c", SPAWN],
             "engine_replica": [replica_titles("kvtier", "engine-cpu")[1], "-c", SLEEP]}
    procs = {n: subprocess.Popen(argv + [f"--session-dir={session}"], executable=sys.executable)
             for n, argv in specs.items()}
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not psutil.Process(procs["router"].pid).children():
            time.sleep(0.1)
        pids = {n: p.pid for n, p in procs.items()}
        pids["router_child"] = psutil.Process(pids["router"]).children()[0].pid
        keeper = PriorityKeeper(10, skip=(specs["engine_replica"][0],), session_dir=session,
                                own=(replica_titles("kvtier", "KVTierRouter"), router_nice))
        keeper.pass_once()
        got = {n: thread_nices(psutil.Process(pid)) for n, pid in pids.items()}
        assert got == {"proxy": {10}, "router": {router_nice}, "router_child": {router_nice},
                       "engine_replica": {0}}, got
    finally:
        _kill_trees(procs.values())
