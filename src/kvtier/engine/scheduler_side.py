"""Scheduler-process half of the compressed engine (vLLM 0.31 V1 `Scheduler` / `KVCacheManager`).

It decides, before each `schedule()`, which running decode requests compact this step, moves their
logical/physical offset, and gives their emptied tail blocks back to the pool at once so this step's
allocations already see the memory. The worker half (`worker_side.py`) performs the copy at the start
of the same step. Everything the worker needs travels as one attribute on the `SchedulerOutput`.

Prefix caching with eviction (`prefix_cache_caps`): a compressed request's blocks enter vLLM's prefix cache
only while they lie wholly inside its protected prefix, the positions no round ever writes, and it reads
cached blocks only there (none when its policy reads the prompt's queries or attention). Full-attention
requests cache and read as in stock vLLM.

Elastic requests (`relieve`, engine/elastic.py) are tracked from the start at full attention and tightened
to their floor when the pool runs short; they cache and read only what their floor's policy protects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from kvtier.policies.base import ATTENTION, QUERIES

from . import compat, final_budget
from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .elastic import Candidate, blocks_for, choose
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
    if spec.elastic:      # the blocks must stay valid once it is tightened: cache what its floor protects
        spec = spec.tightened()
    policy = spec.make_policy()
    cache = policy.protected_len(prompt_len) // block_size * block_size
    read = 0 if policy.needs & {QUERIES, ATTENTION} else cache
    return cache, read


def skip_prefix_cache_reads(vllm_config, request) -> None:
    """In the frontend, for an EngineCoreRequest: a compressed request that may read no cached block
    (prefix_cache_caps) asks vLLM to skip its prefix-cache lookup through the public per-request switch
    `SamplingParams.skip_reading_prefix_cache` (no hit, no query counted; the one prompt-logprob requests
    set). The scheduler's cap (`SchedulerEviction.readable_tokens`) holds regardless."""
    cfg = EngineEvictionConfig.from_vllm(vllm_config)
    sp = getattr(request, "sampling_params", None)
    if cfg is None or sp is None:
        return
    spec = resolve_request_spec(cfg.default, sp.extra_args)
    if (spec.compressed or spec.elastic) and prefix_cache_caps(
            spec, len(request.prompt_token_ids or ()), vllm_config.cache_config.block_size)[1] == 0:
        sp.skip_reading_prefix_cache = True


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
    floor_spec: EvictionSpec | None = None   # an elastic request's spec at its floor (built once, at add)
    tightened: str | None = None             # why an elastic request was tightened ("preemption"/"admission")
    tightened_at: int | None = None          # its token count (logical) then

    @property
    def loose(self) -> bool:
        """An elastic request still at full attention."""
        return self.spec.elastic and not self.spec.compressed


@dataclass
class SchedulerEviction:
    cfg: EngineEvictionConfig
    block_size: int
    pool_blocks: int
    # (tokens a step may schedule, requests that may run at once): from vLLM's public SchedulerConfig at
    # start-up (patch_scheduler.scheduler_init, compat.step_limits); unbounded until then
    limits: tuple[int, int] = (1 << 30, 1 << 30)
    states: dict[str, RequestEviction] = field(default_factory=dict)
    pending: dict[str, CompactionOp] = field(default_factory=dict)
    resets: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)   # compressed requests preempted, not yet resumed
    failed: set[str] = field(default_factory=set)      # policy errors reported by the worker, to abort
    reserved_blocks: int = 0
    blocks_freed: int = 0               # deltas shipped to the worker with the next step
    preempted_compressed: int = 0
    tightenings: dict[str, int] = field(default_factory=dict)   # why ("preemption" / "admission") -> count
    finished: dict[str, dict] = field(default_factory=dict)     # final_budget reports, until this step's outputs

    # -- request lifecycle -------------------------------------------------------------------
    def on_add(self, request) -> None:
        sp = getattr(request, "sampling_params", None)
        if sp is None:
            return
        spec = resolve_request_spec(self.cfg.default, sp.extra_args)
        if spec.compressed or spec.elastic:
            max_tokens = sp.max_tokens if sp.max_tokens is not None else 1 << 30
            cache_cap, read_cap = prefix_cache_caps(spec, request.num_prompt_tokens, self.block_size)
            # an elastic request's bound is its floor's: what reserve admission counts, since it can be
            # tightened there whenever the blocks are needed
            floor_spec = spec.tightened() if spec.elastic else None
            bound = floor_spec or spec
            self.states[request.request_id] = RequestEviction(
                spec, request.num_prompt_tokens,
                bound.max_blocks(request.num_prompt_tokens, max_tokens, self.block_size), cache_cap, read_cap,
                floor_spec=floor_spec)

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
        if self.pending.pop(request.request_id, None) is not None:
            # the round planned this step never runs: the next one takes its number, so the keyed draw's round
            # index stays the count of applied rounds (the worker's events, what a resumed segment's
            # `rounds_before` records and the learner re-derives from)
            st.rounds -= 1
        # The reset (with the row its recompute samples from) is sent when the request resumes: under
        # async scheduling an in-flight token may still be appended after the preemption.
        self.preempted.add(request.request_id)
        self.preempted_compressed += 1

    def on_free(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.finished[request_id] = final_budget.report(st.spec, st.offset, st.tightened, st.tightened_at)
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
        loose = {}
        for request in scheduler.running:
            rid = request.request_id
            st = self.states.get(rid)
            if st is None:
                growth += 1
                continue
            if st.loose:
                loose[rid] = request
            growth += self._plan_one(scheduler, request, st)
        reclaimable = 0
        if loose:
            self.relieve(scheduler, loose)
            # blocks loose elastic requests hold past their floor's bound are theirs only until needed
            reclaimable = sum(max(0, len(compat.request_blocks(scheduler, rid)) - self.states[rid].max_blocks)
                              for rid in loose if self.states[rid].loose)
        free, _usable = compat.pool_counts(scheduler)
        self.reserved_blocks = self.pool_blocks - free + growth - reclaimable

    # -- elastic budgets (engine/elastic.py) ---------------------------------------------------------
    def relieve(self, scheduler, loose: dict) -> None:
        """Tighten running elastic requests (`loose`: those still at full attention, by id) to their floors
        where this step's blocks would not fit: first for the running requests' next tokens (vLLM would
        preempt), then for the next waiting request's prompt when a seat is free (only if tightening can
        make it fit)."""
        bs = self.block_size
        tokens, seats = self.limits
        needs = {}
        for request in scheduler.running:
            st = self.states.get(request.request_id)
            n = min(max(1, request.num_tokens - request.num_computed_tokens), max(tokens, 1))
            tokens -= n
            held = len(compat.request_blocks(scheduler, request.request_id))
            needs[request.request_id] = max(0, blocks_for(request.num_computed_tokens - (st.offset if st else 0) + n, bs) - held)
        need = sum(needs.values())
        cands = {rid: c for rid, r in loose.items() if (c := self._candidate(scheduler, r, needs[rid])) is not None}
        free, _ = compat.pool_counts(scheduler)
        for rid in choose(list(cands.values()), need - free):
            free += self._tighten(scheduler, loose[rid], "preemption") + needs[rid]
            need -= needs[rid]          # counted in what its tightening gives back
            cands.pop(rid)
        head = compat.waiting_head(scheduler)
        if head is not None and len(scheduler.running) < seats and tokens > 0:
            admit = blocks_for(min(head.num_tokens - head.num_computed_tokens, tokens), bs)
            for rid in choose(list(cands.values()), need + admit - free, all_or_nothing=True):
                free += self._tighten(scheduler, loose[rid], "admission") + needs[rid]
                need -= needs[rid]

    def _candidate(self, scheduler, request, need: int) -> Candidate | None:
        """A loose elastic request a tightening would shrink now: decoding, nothing pending, and holding
        enough that its floor's catch-up round runs at once (K + 2r entries or more). What it takes this
        step counts: its held blocks plus the `need` its next token would allocate, against the blocks it
        holds at its floor with that token (K + r + 1 entries)."""
        rid = request.request_id
        st = self.states[rid]
        if rid in self.pending or rid in self.failed or not compat.is_plain_decode(request):
            return None
        sched = st.floor_spec.schedule()
        if request.num_computed_tokens - st.offset < sched.max_cached:
            return None
        return Candidate(rid, len(compat.request_blocks(scheduler, rid)) + need,
                         blocks_for(sched.settled_len + 1, self.block_size))

    def _tighten(self, scheduler, request, why: str) -> int:
        """Set the request's budget to its floor and run its round now; the blocks it freed."""
        st = self.states[request.request_id]
        before = len(compat.request_blocks(scheduler, request.request_id))
        st.spec = st.floor_spec
        st.tightened, st.tightened_at = why, request.num_computed_tokens
        self._compact_if_due(scheduler, request, st)
        self.tightenings[why] = self.tightenings.get(why, 0) + 1
        return before - len(compat.request_blocks(scheduler, request.request_id))

    def _plan_one(self, scheduler, request, st: RequestEviction) -> int:
        """Compact one running compressed request if a round is due; the blocks it may still grow by.
        Only plain decode steps compact (not prefill chunks, not a recompute); under async scheduling the
        newest token may still be a placeholder, its KV is written by the step in flight, which the worker
        finishes before this step's compaction runs."""
        rid = request.request_id
        if st.loose:          # full attention until tightened (relieve); grows like a full request
            return 1
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
        elastic = [st for st in self.states.values() if st.spec.elastic]
        p = StepPayload(ops=list(self.pending.values()), offsets=offsets, resets=dict(self.resets),
                        blocks_freed=self.blocks_freed, preempted_compressed=self.preempted_compressed,
                        tightenings=dict(self.tightenings),
                        elastic=(sum(1 for st in elastic if st.spec.compressed), len(elastic)))
        self.pending.clear()
        self.resets.clear()
        self.tightenings.clear()
        self.blocks_freed = self.preempted_compressed = 0
        return p


def is_waiting(request) -> bool:
    return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
