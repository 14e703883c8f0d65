"""Per-sample eviction counters over every generate call of a sample (all turns, every resumed attempt).

The kvtier server reports its counters per generate call (`TokenOutput.extra_fields`, see
`kvtier.rollout.request_stats.STAT_FIELDS`). A sample of a multi-turn agent loop makes one call per assistant turn,
and verl's fully-async client makes one per attempt of a partial rollout; verl keeps none of the later ones:

* `ToolAgentLoop._handle_generating_state` keeps the first turn's `extra_fields`; of later turns it merges
  only `max_global_steps` and sums the keys of its module constant `SPEC_DECODE_EXTRA_KEYS`
  (`spec_num_draft_tokens`, `spec_num_accepted_tokens`, `spec_num_verify_steps`: speculative-decoding
  counters, which `compute_spec_decode_metrics` reduces). kvtier's counters cannot ride on that: the names
  are spec-decode metrics, the peak KV blocks are a max, not a sum, a full-attention request reports None
  (`int(None)` fails there), and it would cover the tool agent loop only.
* `FullyAsyncLLMServerClient.generate` (verl's `colocate_async` / `separate_async` v1 trainers, the
  fully-async rollouter) rebuilds every output, resumed or not, with four keys of its own
  (`global_steps`, `min_/max_global_steps`, `num_cached_tokens`): no kvtier field survives it.
* Nor can the server add the calls up: `LLMServerClient` sends each call under a fresh uuid unless
  `full_determinism` is set (the trajectory's id never reaches the server), and whatever cumulative value a
  later call reported would be dropped by the two merges above.

So kvtier's agent-loop workers (`kvtier.rollout.trainer_hooks`) add them up on the client side:

1. each trajectory (`AgentLoopWorker._run_agent_loop`, one asyncio task per sample in both the DataProto
   and the TransferQueue worker) runs inside `counting()`, which sets a context variable to a fresh
   `SampleCounters` (tasks the agent loop spawns copy the context, so they record into the same object);
2. the worker's LLM client gets `CountingClientMixin` below verl's own generate logic
   (`counting_client`): for `FullyAsyncLLMServerClient` the class becomes
   `(FullyAsyncLLMServerClient, CountingClientMixin)`, so the resume loop's `super().generate(...)` reaches
   the mixin once per attempt; for `LLMServerClient` the mixin alone. Every server call's `extra_fields`
   is recorded; outside a trajectory (no context) nothing is;
3. before verl's `_agent_loop_postprocess` turns the output into a batch row (DataProto column / the
   TransferQueue's `extra_fields`), the worker writes the totals into the output's `extra_fields`
   (`apply_totals`): events, tokens evicted and preemptions summed, peak KV blocks the max, `kvtier_budget`,
   `kvtier_request_id` (the audit-log key), `kvtier_protect_prefix` and the eviction's seed, buffer and
   policy from the first call, `kvtier_segments` every call's segments in call order (the learner replays a
   multi-call or rebuilt sample by them; None when some call had none: a full-attention call), and
   `kvtier_generate_calls`, the number of calls counted.

Memory: one small object per running trajectory, held by its task's context and gone with it; nothing is
keyed or evicted, so nothing can be dropped while a sample runs. Calls rejected at the server's admission
gate (no `kvtier_budget` in their fields: nothing ran) are not counted. An agent loop that returns several
outputs for one trajectory gets the totals on its last output. A custom client class whose `generate` does
not call `LLMServerClient.generate` is not counted (the sample keeps what its agent loop kept).
"""

from __future__ import annotations

import contextvars
import json
from contextlib import contextmanager
from typing import Any, Iterator

from verl.workers.rollout.llm_server import LLMServerClient

SUM_FIELDS = ("kvtier_eviction_events", "kvtier_tokens_evicted", "kvtier_preemptions")
MAX_FIELDS = ("kvtier_peak_kv_blocks",)
FIRST_FIELDS = ("kvtier_budget", "kvtier_request_id", "kvtier_protect_prefix", "kvtier_seed", "kvtier_buffer",
                "kvtier_policy", "kvtier_policy_params")
CALLS_FIELD = "kvtier_generate_calls"
SEGMENTS_FIELD = "kvtier_segments"       # JSON lists (kvtier.deathtime.segments), concatenated over the calls

_CURRENT: contextvars.ContextVar["SampleCounters | None"] = contextvars.ContextVar("kvtier_sample_counters",
                                                                                  default=None)


def _merge(a, b, op):
    if a is None:
        return b
    if b is None:
        return a
    return op(a, b)


class SampleCounters:
    """The kvtier fields of one sample, over every generate call recorded so far."""

    __slots__ = ("calls", "fields", "segments", "context")

    def __init__(self) -> None:
        self.calls = 0
        self.fields: dict[str, Any] = {}
        self.segments: list[str | None] = []     # each call's `kvtier_segments` (None: it reported none)
        self.context: list[int] | None = None    # the last call's prompt + generated tokens

    def add(self, extra: dict | None, prompt_ids=None, token_ids=None) -> None:
        """One server call's `extra_fields` (ignored unless a kvtier server ran it). prompt_ids / token_ids: what
        it was fed and generated; a call whose prompt does not extend the previous call's context (an agent loop
        that re-tokenized the history) gets no segment record, so the sample goes dense instead of being
        replayed on misaligned segments."""
        if not extra or "kvtier_budget" not in extra:
            return
        self.calls += 1
        record = extra.get(SEGMENTS_FIELD)
        if prompt_ids is not None:
            prompt = list(prompt_ids)
            if self.context is not None and prompt[: len(self.context)] != self.context:
                record = None
            self.context = prompt + list(token_ids or [])
        self.segments.append(record)
        if self.calls == 1:
            self.fields = {k: extra.get(k) for k in FIRST_FIELDS + SUM_FIELDS + MAX_FIELDS}
            return
        for key in SUM_FIELDS:
            self.fields[key] = _merge(self.fields.get(key), extra.get(key), lambda x, y: int(x) + int(y))
        for key in MAX_FIELDS:
            self.fields[key] = _merge(self.fields.get(key), extra.get(key), lambda x, y: max(int(x), int(y)))

    def totals(self) -> dict[str, Any]:
        """The fields to write into the sample's output ({} if no kvtier call was recorded)."""
        if not self.calls:
            return {}
        out = {**self.fields, CALLS_FIELD: self.calls}
        if any(r is not None for r in self.segments):   # a server that reports segments (else no such key)
            out[SEGMENTS_FIELD] = (None if any(r is None for r in self.segments) else
                                   json.dumps([s for r in self.segments for s in json.loads(r)], separators=(",", ":")))
        return out


@contextmanager
def counting() -> Iterator[SampleCounters]:
    """Record the kvtier fields of every generate call made in this context (one trajectory)."""
    counters = SampleCounters()
    token = _CURRENT.set(counters)
    try:
        yield counters
    finally:
        _CURRENT.reset(token)


def current() -> SampleCounters | None:
    return _CURRENT.get()


def apply_totals(output, counters: SampleCounters | None = None) -> dict[str, Any]:
    """Write the trajectory's totals into its (last) agent-loop output's `extra_fields`; the totals."""
    counters = counters if counters is not None else current()
    totals = counters.totals() if counters is not None else {}
    outputs = output if isinstance(output, list) else [output]
    if totals and outputs and outputs[-1] is not None:
        outputs[-1].extra_fields.update(totals)
    return totals


SESSION_KEY = "kvtier_session"   # the trajectory's id, for `protect: first_turn` (rollout.server)


class CountingClientMixin(LLMServerClient):
    """Records each server call's `extra_fields` into the current trajectory's `SampleCounters`, and tells
    the server which trajectory a call belongs to: verl sends each call under a fresh vLLM request id
    unless `full_determinism` is set, while the `request_id` the agent loop passes here (verl's sticky
    session id) is the trajectory's, on every turn and every resumed attempt."""

    async def generate(self, request_id, *args, sampling_params: dict[str, Any], **kwargs):
        sampling_params = {**sampling_params, SESSION_KEY: str(request_id)}
        output = await super().generate(request_id, *args, sampling_params=sampling_params, **kwargs)
        counters = _CURRENT.get()
        if counters is not None and output is not None:
            counters.add(getattr(output, "extra_fields", None), kwargs.get("prompt_ids"),
                         getattr(output, "token_ids", None))
        return output


_COUNTING_CLASSES: dict[type, type] = {}


def counting_client(client):
    """`client` with `CountingClientMixin` under its class's own `generate` (its class is switched to a
    subclass; the instance and its state stay). Anything that is not an `LLMServerClient` is returned as is."""
    if client is None or isinstance(client, CountingClientMixin) or not isinstance(client, LLMServerClient):
        return client
    cls = type(client)
    sub = _COUNTING_CLASSES.get(cls)
    if sub is None:
        # (cls, mixin): cls's generate runs first and its super().generate() is the mixin's, which calls
        # LLMServerClient.generate: exactly once per server call, whatever loop cls runs around it
        bases = (CountingClientMixin,) if cls is LLMServerClient else (cls, CountingClientMixin)
        sub = type(f"KVTierCounting{cls.__name__}", bases, {"__module__": __name__})
        _COUNTING_CLASSES[cls] = sub
    client.__class__ = sub
    return client
