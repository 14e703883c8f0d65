"""The `torch.cuda` stand-in verl reaches through `get_torch_device()` on kvtier's `cpu` platform
(`verl_platform.PlatformCPU.device_module`): memory, stream, event and RNG calls that work on CPU."""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger("kvtier.rollout")


def _noop(*args, **kwargs):
    return None


class _Stream:
    """`torch.cuda.Stream` stand-in: a context manager that does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait_stream(self, *args, **kwargs) -> None:
        return None

    def wait_event(self, *args, **kwargs) -> None:
        return None

    def record_event(self, *args, **kwargs):
        return _Event()


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, *args, **kwargs) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class CpuDeviceModule(ModuleType):
    """What verl reaches through `get_torch_device()` (normally `torch.cuda`), for CPU: memory queries
    report host memory or 0, RNG goes to torch's CPU generator, streams/events are no-ops. Anything
    else comes from `torch.cpu` when it has it, else a no-op (logged once per name at debug level)."""

    def __init__(self) -> None:
        super().__init__("kvtier_cpu_device")
        self._missing: set[str] = set()

    # availability / placement
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    set_device = staticmethod(_noop)
    synchronize = staticmethod(_noop)
    empty_cache = staticmethod(_noop)
    ipc_collect = staticmethod(_noop)
    set_per_process_memory_fraction = staticmethod(_noop)
    reset_peak_memory_stats = staticmethod(_noop)

    # memory (host memory stands in for device memory)
    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    # RNG
    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    # streams / events
    Stream = _Stream
    Event = _Event

    @staticmethod
    def current_stream(device=None) -> _Stream:
        return _Stream()

    @staticmethod
    def stream(s=None) -> _Stream:
        return _Stream()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name not in self._missing:
            self._missing.add(name)
            logger.debug("kvtier cpu platform: %s is a no-op", name)
        return _noop
