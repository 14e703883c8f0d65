"""vLLM worker extension (`worker_extension_cls`): lets the serving process read the kvtier eviction
counters with `collective_rpc("kvtier_eviction_stats")` without pickled functions (which vLLM's
multiprocess engine refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION=1). Kept free of heavy imports:
vLLM imports it in every worker process."""

from __future__ import annotations

QUALNAME = "kvtier.service.worker_ext.KVTierWorkerExtension"


class KVTierWorkerExtension:
    def kvtier_eviction_stats(self, request_ids: list[str] | None = None) -> dict | None:
        ev = getattr(self.model_runner, "kvtier", None)
        return None if ev is None else ev.stats.snapshot(request_ids)

    def kvtier_drain_round_ms(self) -> list[float]:
        """Round times since the last call (the engine deployment's histogram exporter drains them)."""
        ev = getattr(self.model_runner, "kvtier", None)
        return [] if ev is None else ev.stats.drain_round_ms()
