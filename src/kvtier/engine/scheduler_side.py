"""Scheduler-process half of the compressed engine (vLLM 0.31 V1 `Scheduler` / `KVCacheManager`).

It decides, before each `schedule()`, which running decode requests compact this step, moves their
logical/physical offset, and gives their emptied tail blocks back to the pool at once so this step's
allocations already see the memory. The worker half (`worker_side.py`) performs the copy at the start
of the same step. Everything the worker needs travels as one attribute on the `SchedulerOutput`.

Prefix caching with eviction (`prefix_cache_caps`): a compressed request's blocks enter vLLM's prefix cache
only while they lie wholly inside its protected prefix, the positions no round ever writes, and it reads
cached blocks only there (none when its policy reads the prompt's queries or attention). Full-attention
requests cache and read as in stock vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from kvtier.policies.base import ATTENTION, QUERIES

from . import compat
from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .payload import CompactionOp, StepPayload


def prefix_cache_caps(spec: EvictionSpec, prompt_len: int, block_size: int) -> tuple[int, int]:
    """(tokens of a compressed request that may enter the prefix cache, tokens it may read from it).

    Rounds never make a protected position a candidate (`EvictionPolicy.protected_len`: the sinks, and the
    whole prompt or its first `protect_prefix` tokens), so hole filling never writes those slots and tail
    freeing never reaches their blocks: the whole blocks below the protected length hold exactly what
    prefill wrote, and are what may be cached (every later block is rewritten by compaction; caching it
    would hand another request rewritten KV under its logical tokens' hash, R-KV's vLLM bug #6). Reading
    is capped the same way (a cached block past the protected length would be compacted in place, under
    every other request sharing it). A policy reading the prompt's queries or accumulated attention
    (snapkv, h2o, vase, diverse) reads nothing: a hit skips the prefill that feeds it, so its keep-sets
    would change."""
    policy = spec.make_policy()
    cache = policy.protected_len(prompt_len) // block_size * block_size
    read = 0 if policy.needs & {QUERIES, ATTENTION} else cache
    return cache, read


@dataclass
class RequestEviction:
    spec: EvictionSpec
    prompt_len: int
    max_blocks: int
    cache_cap: int = 0       # tokens that may enter vLLM's prefix cache (prefix_cache_caps)
    read_cap: int = 0        # tokens that may be read from it
    offset: int = 0          # logical length - physical length
    rounds: int = 0
    compacted: bool = False  # a round ran since the cache was last (re)built chronologically


@dataclass
class SchedulerEviction:
    cfg: EngineEvictionConfig
    block_size: int
    pool_blocks: int
    states: dict[str, RequestEviction] = field(default_factory=dict)
    pending: dict[str, CompactionOp] = field(default_factory=dict)
    resets: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)   # compressed requests preempted, not yet resumed
    failed: set[str] = field(default_factory=set)      # policy errors reported by the worker, to abort
    reserved_blocks: int = 0
    blocks_freed: int = 0               # deltas shipped to the worker with the next step
    preempted_compressed: int = 0

    # -- request lifecycle -------------------------------------------------------------------
    def on_add(self, request) -> None:
        sp = getattr(request, "sampling_params", None)
        if sp is None:
            return
        spec = resolve_request_spec(self.cfg.default, sp.extra_args)
        if spec.compressed:
            max_tokens = sp.max_tokens if sp.max_tokens is not None else 1 << 30
            cache_cap, read_cap = prefix_cache_caps(spec, request.num_prompt_tokens, self.block_size)
            self.states[request.request_id] = RequestEviction(
                spec, request.num_prompt_tokens,
                spec.max_blocks(request.num_prompt_tokens, max_tokens, self.block_size), cache_cap, read_cap)
            if read_cap == 0:
                compat.skip_prefix_cache_reads(request)   # vLLM's own per-request skip (no hit, no query counted)

    def cacheable_tokens(self, request_id: str, num_tokens: int) -> int:
        """How many of a request's first `num_tokens` tokens may enter the prefix cache."""
        st = self.states.get(request_id)
        return num_tokens if st is None else min(num_tokens, st.cache_cap)

    def readable_tokens(self, request_id: str, num_tokens: int) -> int:
        """How many tokens of a prefix-cache hit of `num_tokens` a request may use (block-aligned)."""
        st = self.states.get(request_id)
        return num_tokens if st is None else min(num_tokens, st.read_cap)

    def on_preempt(self, request) -> None:
        st = self.states.get(request.request_id)
        if st is None:
            return
        # vLLM frees every block and recomputes prompt + outputs from scratch: the compressed state is
        # gone with the blocks, and a copy still pending would write into blocks now owned by others.
        st.offset = 0
        st.compacted = False
        self.pending.pop(request.request_id, None)
        # The reset (with the row its recompute samples from) is sent when the request resumes: under
        # async scheduling an in-flight token may still be appended after the preemption.
        self.preempted.add(request.request_id)
        self.preempted_compressed += 1

    def on_free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.preempted.discard(request_id)
        self.failed.discard(request_id)

    # -- per step ----------------------------------------------------------------------------
    def plan(self, scheduler) -> None:
        """Before vLLM schedules: compact due decode requests and free their tail blocks; then the blocks
        reserve-mode admission counts as taken: every block in use (a block shared through the prefix
        cache once) plus what running requests may still grow by (compressed: up to their bound; full
        attention: one block)."""
        growth = 0
        for request in scheduler.running:
            rid = request.request_id
            st = self.states.get(rid)
            if st is None:
                growth += 1
                continue
            growth += self._plan_one(scheduler, request, st)
        free, _usable = compat.pool_counts(scheduler)
        self.reserved_blocks = self.pool_blocks - free + growth

    def _plan_one(self, scheduler, request, st: RequestEviction) -> int:
        """Compact one running compressed request if a round is due; the blocks it may still grow by.
        Only plain decode steps compact (not prefill chunks, not a recompute); under async scheduling the
        newest token may still be a placeholder, its KV is written by the step in flight, which the worker
        finishes before this step's compaction runs."""
        rid = request.request_id
        if rid not in self.pending and rid not in self.failed and compat.is_plain_decode(request):
            self._compact_if_due(scheduler, request, st)
        return max(0, st.max_blocks - len(compat.request_blocks(scheduler, rid)))

    def _compact_if_due(self, scheduler, request, st: RequestEviction) -> None:
        rid = request.request_id
        sched = st.spec.schedule()
        physical = request.num_computed_tokens - st.offset
        if not sched.due(physical, request.num_computed_tokens - st.prompt_len, st.compacted):
            return
        new_len = sched.settled_len
        keep_blocks = -(-new_len // self.block_size)
        self.blocks_freed += compat.free_tail_blocks(scheduler, rid, keep_blocks)
        st.offset += physical - new_len
        st.rounds += 1
        st.compacted = True
        self.pending[rid] = CompactionOp(
            req_id=rid, old_len=physical, new_len=new_len, keep_blocks=keep_blocks,
            prompt_len=st.prompt_len, spec=st.spec, round=st.rounds,
            query_position=request.num_computed_tokens - 1)

    def on_worker_failures(self, scheduler, req_ids) -> None:
        """The worker's policy failed for these requests (it compacted them with a fallback so the cache
        stays consistent): finish them with an error at this output, the engine keeps serving."""
        if req_ids:
            self.failed.update(req_ids)
            compat.fail_requests(scheduler, req_ids)

    def admit(self, request, shared_blocks: int = 0) -> bool:
        """Reserve mode: a waiting compressed request fits only if every running bound still fits.
        `shared_blocks`: blocks of its prefix-cache hit that running requests already hold (counted)."""
        st = self.states.get(request.request_id)
        if st is None or self.cfg.admission != "reserve":
            return True
        return self.reserved_blocks + st.max_blocks - shared_blocks <= self.pool_blocks

    def admitted(self, request, shared_blocks: int = 0) -> None:
        st = self.states.get(request.request_id)
        if st is not None:
            self.reserved_blocks += st.max_blocks - shared_blocks

    def payload(self, scheduler, scheduler_output) -> StepPayload:
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in [r for r in self.preempted if r in scheduled]:
            # resumed: the recompute prefill samples its next token from row num_tokens - 1, every position back
            self.resets[rid] = scheduler.requests[rid].num_tokens - 1
            self.preempted.discard(rid)
        offsets = {rid: self.states[rid].offset for rid in scheduled
                   if rid in self.states and self.states[rid].offset}
        p = StepPayload(ops=list(self.pending.values()), offsets=offsets, resets=dict(self.resets),
                        blocks_freed=self.blocks_freed, preempted_compressed=self.preempted_compressed)
        self.pending.clear()
        self.resets.clear()
        self.blocks_freed = self.preempted_compressed = 0
        return p


def is_waiting(request) -> bool:
    return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
