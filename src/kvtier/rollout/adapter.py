"""`KVTierServerAdapter`: the worker-side half of the kvtier backend (verl's `BaseRollout`).

verl instantiates it inside the trainer's Ray workers through
`verl.workers.rollout.base.get_rollout_class("kvtier", "async")` (registered by
`kvtier.rollout.verl_plugin`): `engine_workers.ActorRolloutRefWorker` in hybrid mode,
`checkpoint_engine.CheckpointEngineWorker` otherwise. The trainer calls

* `resume(tags)` / `release()` around training -> the server's `wake_up(tags)` / `sleep()`;
* `update_weights(weights, global_steps=...)` with a generator of (name, tensor) in Hugging Face
  checkpoint names -> buckets of CPU tensors sent to the server actor over Ray, handed to the engine
  core as safetensors files in /dev/shm and loaded with vLLM's layerwise reload in the engine's worker
  (`kvtier.rollout.worker_ext`).

Every trainer rank iterates the generator (an FSDP state-dict generator gathers collectively); only
the replica's rollout-rank-0 sends. verl's own vLLM adapter streams over CUDA IPC/ZMQ instead; Ray
object transfer is what works on CPU and is fine for small models — large models on GPUs would
want a device-to-device transfer (not implemented).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Any

import ray
import torch

import kvtier.rollout.verl_plugin  # noqa: F401
from verl.workers.rollout.base import BaseRollout

from .replica import SERVER_NAME_PREFIX

logger = logging.getLogger("kvtier.rollout")


class KVTierServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        local_world_size = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
        rollout_world_size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                              * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.node_rank = self.rollout_rank // local_world_size
        self._has_server = self.rollout_rank == 0
        self.server_handle = None
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20

    @property
    def is_leader_rank(self) -> bool:
        """The rank that talks to the server (verl's CheckpointEngineWorker asks)."""
        return self._has_server

    def _server(self):
        if not self._has_server:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"{SERVER_NAME_PREFIX}server_{self.replica_rank}_{self.node_rank}")
        return self.server_handle

    async def resume(self, tags: list[str]):
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self):
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"kvtier rollout takes wire_format='named_tensors' only, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("kvtier rollout: LoRA adapter sync is not supported (merge LoRA into the "
                                      "weights: actor_rollout_ref.model.lora.merge=True)")
        server = self._server()
        t0 = time.perf_counter()
        if server is not None:
            await server.begin_weight_update.remote()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = sent = 0
        try:
            async for name, tensor in _iterate(weights):
                if server is None:
                    continue  # still drive the generator: it may gather collectively across trainer ranks
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                t = tensor.detach().to("cpu").contiguous()
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= self.bucket_bytes:
                    await server.load_weights_bucket.remote(bucket)
                    sent += len(bucket)
                    bucket, size = [], 0
            if server is not None and bucket:
                await server.load_weights_bucket.remote(bucket)
                sent += len(bucket)
        finally:
            if server is not None:
                report = await server.finish_weight_update.remote(global_steps)
        if server is not None:
            logger.info("kvtier update_weights: %d tensors in %.2fs (%s)", sent, time.perf_counter() - t0, report)
            return report
        return None

    def generate_sequences(self, prompts):
        raise NotImplementedError("kvtier rollout is server-based: generate through verl's agent loop "
                                  "(AgentLoopManager / LLMServerClient), not generate_sequences on the adapter")


async def _iterate(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            if inspect.isawaitable(item):
                item = await item
            yield item
