"""The rollout server's weight sync: weights arrive as buckets of named tensors over Ray
(`begin_weight_update` / `load_weights_bucket` / `finish_weight_update`), reach the engine core as a
safetensors file in /dev/shm, and are loaded with vLLM's layerwise reload in the worker
(`kvtier.rollout.worker_ext`) — instead of verl's CUDA-IPC/ZMQ transfer. A bucket is written only after
checking the folder has room (`WeightSyncSpaceError`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Any


class WeightSyncSpaceError(RuntimeError):
    """The shared-memory folder cannot hold a weight bucket."""


# safetensors: 8-byte header length + a JSON header (name, dtype, shape, offsets) per tensor
_SAFETENSORS_OVERHEAD = 4096
_SAFETENSORS_PER_TENSOR = 256


def check_free_space(directory: str, needed: int) -> None:
    """Raise `WeightSyncSpaceError` naming the bytes needed and available if `directory` cannot hold
    `needed` more bytes (Docker's default /dev/shm is 64 MiB; verl's default bucket is 2 GiB)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise WeightSyncSpaceError(
            f"kvtier weight sync: {directory} has {free} bytes ({free / 2**20:.1f} MiB) free, a weight bucket needs "
            f"{needed} bytes ({needed / 2**20:.1f} MiB). Give the rollout servers more shared memory (docker run "
            f"--shm-size, a Kubernetes emptyDir with medium: Memory) or send smaller buckets "
            f"(actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes)")


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class WeightSyncMixin:
    """`KVTierServer`'s weight-sync methods (verl's checkpoint engine calls them). Needs `self.engine` (the
    AsyncLLM, with kvtier's rollout worker extension), `self.global_steps` and `self.clear_kv_cache()`."""

    async def begin_weight_update(self) -> None:
        await self.engine.collective_rpc("kvtier_begin_weight_update")

    async def load_weights_bucket(self, named_tensors: list) -> int:
        """One bucket of (HF checkpoint name, tensor) pairs. Handed to the engine core as a safetensors file
        in shared memory (same node: the engine core is this actor's child process)."""
        from safetensors.torch import save_file

        tensors = {str(name): t.detach().to("cpu").contiguous() for name, t in named_tensors}
        directory = _shm_dir() or tempfile.gettempdir()
        needed = (_SAFETENSORS_OVERHEAD + sum(t.numel() * t.element_size() + _SAFETENSORS_PER_TENSOR
                                               for t in tensors.values()))
        check_free_space(directory, needed)
        fd, path = tempfile.mkstemp(prefix="kvtier-weights-", suffix=".safetensors", dir=directory)
        os.close(fd)
        try:
            await asyncio.to_thread(save_file, tensors, path)
            res = await self.engine.collective_rpc("kvtier_load_weights_file", args=(path,))
        finally:
            os.unlink(path)
        return res[0] if res else 0

    async def finish_weight_update(self, global_steps: int | None = None) -> dict[str, Any]:
        res = await self.engine.collective_rpc("kvtier_finish_weight_update")
        await self.clear_kv_cache()
        if global_steps is not None:
            self.global_steps = global_steps
        return res[0] if res else {}

    async def update_weights(self, named_tensors: list, global_steps: int | None = None) -> dict[str, Any]:
        """All weights in one call (small models, tests)."""
        await self.begin_weight_update()
        try:
            await self.load_weights_bucket(named_tensors)
        finally:
            report = await self.finish_weight_update(global_steps)
        return report
