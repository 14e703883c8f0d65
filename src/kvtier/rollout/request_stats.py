"""Per-sample eviction counters on the rollout server: read from the engine's worker after a request
finishes (lookups of concurrently finishing requests coalesced) and returned in `TokenOutput.extra_fields`."""

from __future__ import annotations

import asyncio
import logging

from .settings import KVTierRolloutSettings

logger = logging.getLogger("kvtier.rollout")

# TokenOutput.extra_fields keys (one value per sample; verl's agent loop turns each into a column of
# DataProto.non_tensor_batch). Counters are None for requests the engine did not compress.
STAT_FIELDS = {
    "kvtier_eviction_events": "events",          # eviction rounds applied to this sample
    "kvtier_tokens_evicted": "tokens_evicted",   # per KV head (each head evicts the same count)
    "kvtier_peak_kv_blocks": "peak_blocks",      # most KV blocks the sample ever held
    "kvtier_preemptions": "preemptions",
}


class StatsFetcher:
    """Coalesces the per-request counter look-ups of concurrently finishing requests into one
    `collective_rpc` (the engine core serves utility calls between steps)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pending: dict[str, list[asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    async def get(self, request_id: str) -> dict | None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.setdefault(request_id, []).append(fut)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, {}
            try:
                results = await self.engine.collective_rpc("kvtier_request_stats", args=(list(batch),))
                found = results[0] if results else {}
            except Exception:  # counters are best effort; generation results must not fail on them
                logger.exception("kvtier: reading eviction counters failed")
                found = {}
            for rid, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(found.get(rid))


def request_spec(settings: KVTierRolloutSettings, params):
    """The EvictionSpec this request runs with (vLLM SamplingParams with kvtier's extra_args over the
    engine default); None when eviction is off."""
    from kvtier.engine.config import resolve_request_spec

    if not settings.eviction.enabled:
        return None
    return resolve_request_spec(settings.eviction.default, params.extra_args)


def seeded_spec(settings: KVTierRolloutSettings, params, request_id: str, deterministic_seed: int | None):
    """The request's EvictionSpec (None: eviction off), with a `kvtier_seed` assigned (and written into
    `params.extra_args`) when it is compressed and has none."""
    spec = request_spec(settings, params)
    if spec is not None and spec.compressed and spec.seed is None:
        seed = eviction_seed(request_id, deterministic_seed)
        params.extra_args = {**(params.extra_args or {}), "kvtier_seed": seed}
        spec = spec.model_copy(update={"seed": seed})
    return spec


def policy_params(spec) -> str | None:
    """The compressed request's policy keyword arguments as sorted JSON (`kvtier_policy_params`; None if
    none): with the seed, buffer and policy name, what rebuilds the policy the engine ran (protect_prefix
    included)."""
    import json

    kw = spec.policy_kwargs()
    return json.dumps(kw, sort_keys=True) if kw else None


def segments_record(spec, prompt_len: int, generated: int, counters: dict | None) -> str | None:
    """`kvtier_segments` of one generate call: its segments (`kvtier.deathtime.segments.call_segments`: one
    from the prompt, one after each recompute the engine reported) as JSON, so the learner can replay a sample
    made of several calls or rebuilt caches segment by segment; None for full attention and elastic budgets
    (their rounds follow a budget that changes mid-request) and when the engine's counters could not be read
    (its recomputes unknown: the sample goes dense, counted, rather than replayed under a one-cache record)."""
    if spec is None or not spec.compressed or spec.elastic or counters is None:
        return None
    from kvtier.deathtime.segments import call_segments, segments_to_json

    return segments_to_json(call_segments(prompt_len, generated, counters.get("resets") or [],
                                          seed=spec.seed, budget=spec.budget, buffer=spec.buffer,
                                          policy=spec.policy_name, policy_params=policy_params(spec)))


def sample_fields(spec, protect_prefix: int | None, prompt_len: int, generated: int, counters: dict | None,
                  request_id: str) -> dict:
    """The `kvtier_*` extra_fields of one generate call: the request's budget and what the learner needs to
    re-derive its evictions (seed, buffer, policy and its parameters, segments), and the engine's counters
    (STAT_FIELDS; None for full attention, 0 where the engine's counters could not be read)."""
    budget = spec.budget if spec is not None else None
    compressed = budget is not None
    extra = {
        "kvtier_request_id": (counters or {}).get("internal_request_id", request_id),
        "kvtier_budget": budget,
        "kvtier_protect_prefix": protect_prefix if compressed else None,
        "kvtier_seed": spec.seed if compressed else None,
        "kvtier_buffer": spec.buffer if compressed else None,
        "kvtier_policy": spec.policy_name if compressed else None,
        "kvtier_policy_params": policy_params(spec) if compressed else None,
        "kvtier_segments": segments_record(spec, prompt_len, generated, counters),
    }
    for key, field in STAT_FIELDS.items():
        extra[key] = (counters or {}).get(field, 0) if compressed else None
    return extra


def eviction_seed(request_id: str, deterministic_seed: int | None) -> int:
    """The `kvtier_seed` a compressed request gets when it has none: what the learner re-derives a `random`
    sample's evictions from (`kvtier.deathtime.simulate_deaths`), so nothing but this integer travels. Fresh
    entropy, or (verl's full_determinism) a function of the run's seed and the request id."""
    import os
    import zlib

    if deterministic_seed is not None:
        return zlib.crc32(f"{deterministic_seed}:{request_id}".encode())
    return int.from_bytes(os.urandom(4), "little")
