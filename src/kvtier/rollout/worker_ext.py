"""vLLM worker extension for the kvtier rollout server (`worker_extension_cls`): the engine's extension
(eviction counters, `kvtier.engine.worker_ext`) plus weight loading for verl's weight sync.

The server calls these methods by name through `AsyncLLM.collective_rpc`; they run in the vLLM worker
process (on CPU: the EngineCore process), between engine steps.

Weight updates go through vLLM's layerwise reload (`initialize_layerwise_reload` ->
`model.load_weights` -> `finalize_layerwise_reload`): on CPU, vLLM repacks every linear weight into a
kernel format at load time and drops the original parameter (`dispatch_cpu_unquantized_gemm`), so a
plain `model.load_weights` after start-up would not reach the weights the kernels read. The reload
restores checkpoint-format parameters, loads, and re-runs `process_weights_after_loading`.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine import worker_ext


class WeightUpdateMixin:
    """begin -> load_weights_file (one call per bucket) -> finish; one update at a time per worker."""

    def kvtier_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_kvtier_updating", False):
            raise RuntimeError("a weight update is already in progress")
        initialize_layerwise_reload(self.model_runner.get_model())
        self._kvtier_updating = True
        self._kvtier_loaded: set[str] = set()

    def kvtier_load_weights_file(self, path: str) -> int:
        """Load one bucket of checkpoint-format weights from a safetensors file the server wrote (tensors
        do not survive vLLM's msgpack utility-call path as tensors); returns how many were loaded."""
        from safetensors.torch import load_file

        if not getattr(self, "_kvtier_updating", False):
            raise RuntimeError("kvtier_load_weights_file outside kvtier_begin/finish_weight_update")
        tensors = load_file(path)
        loaded = self.model_runner.get_model().load_weights(iter(tensors.items()))
        if loaded:
            self._kvtier_loaded |= set(loaded)
        return len(tensors)

    def kvtier_finish_weight_update(self) -> dict[str, Any]:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not getattr(self, "_kvtier_updating", False):
            raise RuntimeError("no weight update in progress")
        model = self.model_runner.get_model()
        try:
            finalize_layerwise_reload(model, self.model_runner.model_config)
        finally:
            self._kvtier_updating = False
        expected = {n for n, _ in model.named_parameters()}
        return {"loaded": len(self._kvtier_loaded), "parameters": len(expected),
                "missing": sorted(expected - self._kvtier_loaded)[:20]}


class KVTierWorkerExtension(WeightUpdateMixin, worker_ext.KVTierWorkerExtension):
    """The rollout's worker extension (`settings.WORKER_EXTENSION`): eviction counters + weight loading."""
