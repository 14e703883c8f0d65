"""vLLM worker extension (`worker_extension_cls`): the kvtier eviction counters, read by name through
`collective_rpc("kvtier_...")`.

vLLM mixes these methods into its worker class, so a caller needs no pickled function (vLLM's
multiprocess engine refuses those unless VLLM_ALLOW_INSECURE_SERIALIZATION=1). They run in the worker
process (on CPU with the `uni` executor: the EngineCore process) between engine steps. Kept free of heavy
imports: vLLM imports this module in every worker process. The service names this class; the rollout
names its subclass with weight loading (`kvtier.rollout.worker_ext`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

QUALNAME = "kvtier.engine.worker_ext.KVTierWorkerExtension"


def _eviction_counters(worker):
    ev = getattr(worker.model_runner, "kvtier", None)
    return None if ev is None else ev.stats


def worker_eviction_stats(worker, request_ids: list[str] | None = None) -> dict | None:
    """Engine totals and per-request counters keyed by vLLM's internal request id (all when None), read
    from any vLLM worker (also one built without this extension, through a pickled-function RPC)."""
    stats = _eviction_counters(worker)
    return None if stats is None else stats.snapshot(request_ids)


class KVTierWorkerExtension:
    """Every method answers "no eviction" (None or empty) when the engine was built without kvtier."""

    def _kvtier_stats(self):
        return _eviction_counters(self)

    def kvtier_eviction_stats(self, request_ids: list[str] | None = None) -> dict | None:
        """Engine totals and per-request counters keyed by vLLM's internal request id (all when None)."""
        return worker_eviction_stats(self, request_ids)

    def kvtier_engine_stats(self) -> dict[str, Any] | None:
        """Engine totals and the round-time histogram bounds, without per-request counters."""
        snap = self.kvtier_eviction_stats([])
        return None if snap is None else {"engine": snap["engine"], "round_ms_bucket_bounds": snap["round_ms_bucket_bounds"]}

    def kvtier_request_stats(self, request_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """Per-request eviction counters, keyed by the *external* request id (None: no counters).

        vLLM makes the internal id `<external id>-<8 random chars>`; when several internal ids share an
        external id, the most recent one wins."""
        stats = self._kvtier_stats()
        out: dict[str, dict[str, Any] | None] = {rid: None for rid in request_ids}
        if stats is None:
            return out
        wanted = set(request_ids)
        for internal, counters in list(stats.requests.items()):
            rid = internal if internal in wanted else internal.rsplit("-", 1)[0]
            if rid in wanted:
                out[rid] = {"internal_request_id": internal, **asdict(counters)}
        return out

    def kvtier_drain_round_ms(self) -> list[float]:
        """Round times since the last call (the engine deployment's histogram exporter drains them)."""
        stats = self._kvtier_stats()
        return [] if stats is None else stats.drain_round_ms()
