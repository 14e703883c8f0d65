"""Which replica of an engine deployment a generation goes to: the one with the most free KV blocks
(issue #37 item 2), through Ray Serve's request-router extension point (`RequestRouterConfig`).

Each engine replica reports its free blocks with `record_routing_stats` (engine_server.KVTierLLMServer,
every `request_routing_stats_period_s`); Serve hands them to this router as `RunningReplica.routing_stats`.
Generations (`kvtier_generate`) rank the replicas by free blocks, most first, each its own rank, so Serve
tries the roomiest and falls back in order when one is at `max_ongoing_requests`. Every other call (the
router's load polls, stats) keeps Serve's spread: one rank of all candidates, so every replica is polled.
A replica that has not reported yet counts as empty (most room): a new replica gets traffic at once. A
replica that reports its vLLM engine errored ranks last, whatever its free blocks: until Serve replaces it,
generations go to the others.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, RequestRouter

GENERATE = "kvtier_generate"
UNKNOWN = float("inf")


def free_blocks(replica) -> float:
    stats = getattr(replica, "routing_stats", None) or {}
    value = stats.get("free_blocks")
    return UNKNOWN if value is None else float(value)


def errored(replica) -> bool:
    return bool((getattr(replica, "routing_stats", None) or {}).get("errored"))


def rank_by_free_kv(replicas: list, call_method: str | None) -> list[list]:
    """The ranks `choose_replicas` returns (pure; tests call it with stand-ins)."""
    if call_method != GENERATE or len(replicas) < 2:
        return [list(replicas)]
    return [[r] for r in sorted(replicas, key=lambda r: (errored(r), -free_blocks(r)))]


class MostFreeKVRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        method = pending_request.metadata.call_method if pending_request is not None else None
        return rank_by_free_kv(candidate_replicas, method)
