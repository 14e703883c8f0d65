"""CPU priority on a Ray that `kvtier serve` starts: vLLM's engine processes first, Ray's and Serve's after.

Why: with synchronous scheduling every engine step waits on vLLM's EngineCore process (schedule, hand the
batch to the worker, read the result) and, on a CPU box, vLLM binds its worker to the other cores and leaves
one core for the EngineCore and the frontend. Behind Ray Serve that core is shared with Ray's daemons, Serve's
proxy, controller, router and the engine replica's frontend; a step whose EngineCore waits out one of their
time slices is a slower step for every sequence in the batch. Measured on 2 cores (32 x 3000 tokens,
`kvtier bench serve --arms full`): Ray's default (its workers, so the engine, at nice 15; its daemons at 0)
0.85x stock vLLM's tok/s; everything at nice 0 0.77x; the engine at 0 and everything else at 19 0.96x.

So: Ray's workers start at nice 0 (`RAY_worker_niceness`, read by the raylet when it starts), and a keeper
thread in the driver raises every process of the Ray it started to ``nice``, thread by thread (Linux keeps
a nice value per thread), every ``period_s`` so restarted replicas and new threads follow -- except vLLM's
EngineCore and Worker processes (process titles ``VLLM::...``), Ray's idle pooled workers (``ray::IDLE``)
and the engine replicas: their vLLM processes inherit the nice value they are spawned with, so an engine
replica lowers itself once its engine has started (`KVTierVLLMEngine.start`, told by ``NICE_ENV``). The
keeper knows an engine replica by that variable in its environment, fixed when Ray starts the process, as
well as by its title: a replica lowered in a window where its title said otherwise would spawn vLLM's
engine core at the serving nice value (seen once in CI, an EngineCore at 19). Only raising:
no privilege is needed and nothing is ever made more urgent than the engine. On a cluster kvtier only joins
(KubeRay) none of this runs: the cluster's own settings apply.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("kvtier.service")

# Subtrees never lowered: vLLM's processes (titles VLLM::EngineCore, VLLM::Worker...), Ray's idle pooled
# workers and workers that have no title yet (either may become an engine replica)
ALWAYS_SKIPPED = ("VLLM::", "ray::IDLE")
UNTITLED_WORKER = "default_worker.py"   # python [-u] .../ray/_private/workers/default_worker.py ...
# Left as they are, their children still lowered: the raylet forks Ray's workers, which inherit its nice
# value (an engine replica started by a lowered raylet would hand it to its vLLM processes)
PARENTS_KEPT = ("raylet",)
NICE_ENV = "KVTIER_SERVING_NICE"   # set in an engine replica's env: lower yourself once the engine is up


def prepare_local_ray() -> None:
    """Before `ray.init` starts a local Ray: its workers (the engine replicas, hence vLLM's processes) at
    nice 0 rather than Ray's default 15."""
    os.environ.setdefault("RAY_worker_niceness", "0")


def replica_titles(app_name: str, deployment: str) -> tuple[str, str]:
    """The process titles Ray Serve gives a replica of `deployment` in app `app_name`: while its actor
    is being created, then once it runs."""
    return f"ray::SERVE_REPLICA::{app_name}#{deployment}#", f"ray::ServeReplica:{app_name}:{deployment}"


def _names(proc, marker: str) -> bool:
    try:
        return marker in " ".join(proc.cmdline() or ())
    except Exception:  # noqa: BLE001 - psutil.Error: gone meanwhile
        return False


def _titled(proc, prefixes: tuple[str, ...], argv: list[str] | None = None) -> bool:
    """Whether the process's title (command line `argv`, read if not given, or name) starts with one of
    `prefixes`."""
    if not prefixes:
        return False
    argv = (proc.cmdline() or []) if argv is None else argv
    return " ".join(argv).startswith(prefixes) or proc.name().startswith(prefixes)


def _skipped(proc, prefixes: tuple[str, ...], env: str | None = None) -> bool:
    """Titled with one of `prefixes`, an untitled Ray worker (told by its script; not the raylet, which
    names the script later in its command line), or started with the variable `env` set."""
    argv = proc.cmdline() or []
    if _titled(proc, prefixes, argv) or any(a.endswith(UNTITLED_WORKER) for a in argv[:3]):
        return True
    return env is not None and env in proc.environ()


def lower_serving_priority(nice: int, include_self: bool, skip: tuple[str, ...] = (), marker: str | None = None,
                           own: tuple[tuple[str, ...], int] | None = None, skip_env: str | None = None) -> int:
    """Raise every thread of this process's descendants (and of this process if include_self) to `nice`,
    leaving out the whole subtree of a process whose title starts with one of ALWAYS_SKIPPED or `skip` (or
    an untitled Ray worker), and with `marker` (a Ray session directory) only the subtrees of this process's
    children whose command line names it (Ray's daemons; not other children of the same process). `own`
    (titles, value): the subtree of a process with one of those titles gets that value instead (0: left as
    it is). `skip_env`: the whole subtree of a process started with that environment variable set is left
    out too (not checked for this process itself). One walk of the tree. Returns how many threads changed."""
    import psutil

    me = psutil.Process()
    prefixes = ALWAYS_SKIPPED + tuple(skip)
    own_titles, own_nice = own if own else ((), nice)
    changed = 0
    todo = [(me, nice)] if include_self else [(c, nice) for c in me.children() if marker is None or _names(c, marker)]
    while todo:
        proc, target = todo.pop()
        try:
            if _skipped(proc, prefixes, None if proc.pid == me.pid else skip_env):
                continue
            if _titled(proc, own_titles):
                target = own_nice
            if target == 0:   # nothing to raise in this subtree
                continue
            todo.extend((c, target) for c in proc.children())
            if proc.name() in PARENTS_KEPT:
                continue
            for t in proc.threads():
                if os.getpriority(os.PRIO_PROCESS, t.id) < target:
                    os.setpriority(os.PRIO_PROCESS, t.id, target)
                    changed += 1
        except (psutil.Error, OSError):   # exited or being replaced meanwhile: the next pass sees it
            continue
    return changed


class PriorityKeeper:
    """A daemon thread in the driver that lowers the Ray it started (the processes under its children that
    name `session_dir`; the driver itself stays as it is) now and every `period_s` until stop()."""

    def __init__(self, nice: int, skip: tuple[str, ...] = (), session_dir: str | None = None, period_s: float = 5.0,
                 own: tuple[tuple[str, ...], int] | None = None):
        """own: (titles, nice) for processes given a nice value of their own (the router's `router_nice`):
        left out of the main pass, raised to theirs (0: left as they are)."""
        self.nice, self.skip, self.session_dir, self.period_s, self.own = nice, tuple(skip), session_dir, period_s, own
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-cpu-priority", daemon=True)

    def start(self) -> "PriorityKeeper":
        router = f", the router at {self.own[1]} (server.router_nice)" if self.own else ""
        logger.warning("kvtier: Ray's and Serve's processes run at nice %d, vLLM's engine processes at 0%s, so the "
                       "engine core's scheduler gets its CPU first (server.serving_nice: null turns this off)",
                       self.nice, router)
        self._thread.start()
        return self

    def pass_once(self) -> None:
        lower_serving_priority(self.nice, include_self=False, skip=self.skip, marker=self.session_dir, own=self.own,
                               skip_env=NICE_ENV)

    def _run(self) -> None:
        # the keeper's own passes (psutil over every thread of the session) at the serving nice value too: at
        # the driver's 0 they would compete with the engine core (and a request's first token) every period_s
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError:
            pass
        while True:
            try:
                self.pass_once()
            except Exception as exc:  # noqa: BLE001 - priority is an optimisation, never a failure
                logger.warning("kvtier: CPU priority pass failed: %s", exc)
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
