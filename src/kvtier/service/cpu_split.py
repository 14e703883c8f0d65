"""Keep a CPU engine's compute cores for the engine: Ray's and Serve's processes run on the reserved CPU.

vLLM's CPU worker binds its OpenMP threads to all allowed CPUs but one (`VLLM_CPU_OMP_THREADS_BIND=auto`
reserves one for the engine core's scheduler and the frontend) and pins nothing else. Stock vLLM's
server has two other processes to put on the reserved CPU; a kvtier service also has Ray's daemons
(GCS, raylet, agents) and Serve's controller, proxy, router and engine replica, and the OS scheduler
spreads those over the worker's cores too, preempting the forward pass on every busy tick (on this
2-core box that cost kvtier's full-attention tier about a tenth of stock vLLM's throughput).

`server.cpu_split: auto` (the default) does for a local Ray what vLLM's binding does for its own worker:
the driver's CPU affinity is narrowed to the reserved CPU while it starts Ray (every Ray process inherits
it: raylet and GCS are its children, Serve's actors and vLLM's processes are theirs), and the engine's
worker is bound to the rest by an explicit `VLLM_CPU_OMP_THREADS_BIND` in its runtime env. It applies
to the case it was measured in: a local Ray with one CPU engine deployment, one replica, one rank, and
no binding of the user's own; anything else is left to vLLM's binding with one log line saying why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .config import ServiceConfig

logger = logging.getLogger("kvtier.service")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CpuSplit:
    engine: tuple[int, ...]     # the engine worker's OpenMP threads
    reserved: tuple[int, ...]   # everything else the service starts

    @property
    def engine_bind(self) -> str:
        """`VLLM_CPU_OMP_THREADS_BIND` for the engine (one rank): "0,1,2"."""
        return ",".join(map(str, self.engine))

    def describe(self) -> str:
        return (f"kvtier: CPU split (server.cpu_split: auto): the engine worker on CPUs {list(self.engine)}, "
                f"Ray's and Serve's processes and vLLM's engine core on {list(self.reserved)}")


def plan_cpu_split(cfg: ServiceConfig, allowed: set[int] | None = None,
                   environ: dict[str, str] | None = None) -> tuple[CpuSplit | None, str]:
    """The split for this service on this machine, or (None, why not)."""
    environ = os.environ if environ is None else environ
    if cfg.server.cpu_split == "off":
        return None, "server.cpu_split is off"
    if cfg.server.ray_address is not None:
        return None, "the service joins a Ray cluster it did not start (server.ray_address)"
    if len(cfg.engines) != 1:
        return None, f"{len(cfg.engines)} engine deployments (the split is for one)"
    (name, eng), = cfg.engines.items()
    if eng.accelerator != "cpu":
        return None, f"engine {name!r} is not a CPU engine"
    if int(eng.deployment.get("num_replicas", 1) or 1) != 1:
        return None, f"engine {name!r} has more than one replica"
    ranks = int(eng.engine_kwargs.get("tensor_parallel_size", 1)) * int(eng.engine_kwargs.get("pipeline_parallel_size", 1))
    if ranks != 1:
        return None, f"engine {name!r} runs {ranks} ranks"
    if BIND_ENV in environ or BIND_ENV in eng.runtime_env.get("env_vars", {}):
        return None, f"{BIND_ENV} is set: the user's binding applies"
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if len(cpus) < 2:
        return None, f"only {len(cpus)} CPU allowed"
    return CpuSplit(engine=tuple(cpus[:-1]), reserved=tuple(cpus[-1:])), ""


class narrowed_affinity:
    """Context manager: this thread's CPU affinity is `cpus` inside (processes it starts inherit it), and
    what it was afterwards (an in-process test session goes on with every CPU)."""

    def __init__(self, cpus: tuple[int, ...] | None):
        self.cpus = cpus
        self._old: set[int] | None = None

    def __enter__(self):
        if self.cpus:
            self._old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(self.cpus))
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            os.sched_setaffinity(0, self._old)
