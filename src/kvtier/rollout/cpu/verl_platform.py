"""A `cpu` platform for verl 0.9.1, so verl's own trainer (FSDP workers, torch.distributed over gloo) runs
on a machine without accelerators — through verl's extension points, no verl file changed.

Load it in every verl process *before* anything asks verl for its platform, and select it:

    VERL_PLATFORM=cpu
    VERL_USE_EXTERNAL_MODULES=kvtier.rollout.cpu.verl_platform,kvtier.rollout.verl_plugin   # this module first

(`kvtier rl smoke` sets both, in the driver and in Ray's runtime environment.) verl's `__init__` imports the
modules named in `VERL_USE_EXTERNAL_MODULES` before any verl module resolves the platform singleton
(`verl.plugin.platform.get_platform`), so registering here is early enough.

What it does, and why (each item is a verl 0.9.1 assumption that fails on CPU):

1. **`PlatformCPU`** registered in `verl.plugin.platform.PlatformRegistry` as `cpu`: device name `cpu`,
   communication backend `gloo`, a `torch.cuda` stand-in (`device_module`, in `device_module.py`)
   whose memory/stream/RNG calls work on CPU. `current_device()` returns `torch.device("cpu")`, not an int: verl passes
   `get_device_id()` to `.to()` / `device=`, where an int means a CUDA index. Never auto-detected
   (`is_platform_available` is False): only `VERL_PLATFORM=cpu` selects it.
2. **Ray resource name `GPU`**: verl's `ResourcePoolManager` always builds its pools with `use_gpu=True`
   and counts only Ray `GPU`/`NPU` resources, so a CPU run declares *logical* GPUs
   (`ray_kwargs.ray_init.num_gpus=<n_gpus_per_node>`) that only drive placement. The visible-devices
   variable is a kvtier-private name, so the rollout server (which exports it) leaves
   `CUDA_VISIBLE_DEVICES` alone.
3. **`initialize_global_process_group_ray`** (`verl.utils.distributed`, imported by name into
   `verl.workers.engine_workers`): its default backend string `"cpu:gloo,{device}:{backend}"` becomes
   `"cpu:gloo,cpu:gloo"` on CPU, which torch rejects. Wrapped to default to `"gloo"` on this platform;
   both module attributes are patched (engine_workers when it is imported, through an import hook).
4. **FSDP engines for `device="cpu"`**: `FSDPEngineWithLMHead` / `FSDPEngineWithValueHead` register for
   `cuda` and `npu` only and `EngineRegistry.get_engine_cls` looks up `get_device_name()`; the same
   classes are registered for `cpu` when `verl.workers.engine.fsdp.transformer_impl` is imported (import
   hook; importing it here would load transformers/peft into every verl process, vLLM's included).
5. **FSDP2 `CPUOffloadPolicy(pin_memory=True)`** (the reference policy's forward-only engine): pinning host
   memory needs an accelerator; `transformer_impl.CPUOffloadPolicy` is replaced by a subclass that never
   pins (offloading to the CPU is a no-op there anyway).

Config the trainer also needs on CPU (set by `kvtier rl smoke`, not patchable here): `strategy=fsdp2`
(FSDP1 passes an int `device_id` to `FullyShardedDataParallel`), `use_remove_padding=false` (flash-attn
varlen), `attn_implementation=sdpa`, `use_torch_compile=false`, `trainer.device=cpu`.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from .device_module import CpuDeviceModule

logger = logging.getLogger("kvtier.rollout")

PLATFORM_NAME = "cpu"
VISIBLE_DEVICES_ENV = "KVTIER_CPU_VISIBLE_DEVICES"
MODULE = __name__


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only machines (see the module doc)."""

    _device_module = CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False          # never auto-detected: VERL_PLATFORM=cpu only

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return VISIBLE_DEVICES_ENV

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"          # logical GPUs (ray_init.num_gpus): verl's pools count only GPU/NPU

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def selected() -> bool:
    """Is this process running verl on the CPU platform?"""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


# -- patches applied when a verl module is imported ------------------------------------------------
def _cpu_process_group_init(original: Callable) -> Callable:
    if getattr(original, "_kvtier_cpu", False):
        return original

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._kvtier_cpu = True
    initialize_global_process_group_ray.__wrapped__ = original
    return initialize_global_process_group_ray


def _patch_distributed(module: ModuleType) -> None:
    module.initialize_global_process_group_ray = _cpu_process_group_init(module.initialize_global_process_group_ray)


def _patch_engine_workers(module: ModuleType) -> None:
    module.initialize_global_process_group_ray = _cpu_process_group_init(module.initialize_global_process_group_ray)


def _register_fsdp_engines(module: ModuleType) -> None:
    from verl.workers.engine.base import EngineRegistry

    if getattr(module, "CPUOffloadPolicy", None) is not None and not getattr(module.CPUOffloadPolicy, "_kvtier_cpu",
                                                                                False):
        module.CPUOffloadPolicy = _unpinned_offload_policy(module.CPUOffloadPolicy)

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=PLATFORM_NAME)(
        module.FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=PLATFORM_NAME)(
        module.FSDPEngineWithValueHead)


def _unpinned_offload_policy(base: type) -> type:
    """FSDP2's `CPUOffloadPolicy` with `pin_memory=False` whatever the caller asks: verl builds the reference
    policy's engine (forward only) with `CPUOffloadPolicy(pin_memory=True)`, and pinning host memory needs
    an accelerator ("Cannot access accelerator device when none is available")."""

    class CPUOffloadPolicy(base):
        _kvtier_cpu = True

        def __init__(self, pin_memory: bool = True, **kwargs) -> None:
            super().__init__(pin_memory=False, **kwargs)

    return CPUOffloadPolicy


def install() -> None:
    """Apply the patches: to modules already imported now, to the others right after their import."""
    from kvtier.rollout.import_hooks import when_imported

    if _INSTALLED:
        return
    _INSTALLED.append(True)
    when_imported("verl.utils.distributed", _patch_distributed,
                  ready=lambda m: hasattr(m, "initialize_global_process_group_ray"))
    when_imported("verl.workers.engine_workers", _patch_engine_workers,
                  ready=lambda m: hasattr(m, "initialize_global_process_group_ray"))
    when_imported("verl.workers.engine.fsdp.transformer_impl", _register_fsdp_engines,
                  ready=lambda m: hasattr(m, "FSDPEngineWithValueHead"))


_INSTALLED: list[bool] = []


if selected():
    install()
