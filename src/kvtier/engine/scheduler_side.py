"""Scheduler-process half of the compressed engine (vLLM 0.31 V1 `Scheduler` / `KVCacheManager`).

It decides, before each `schedule()`, which running decode requests compact this step, moves their
logical/physical offset, and gives their emptied tail blocks back to the pool at once so this step's
allocations already see the memory. The worker half (`worker_side.py`) performs the copy at the start
of the same step. Everything the worker needs travels as one attribute on the `SchedulerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from . import compat
from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .payload import CompactionOp, StepPayload


@dataclass
class RequestEviction:
    spec: EvictionSpec
    prompt_len: int
    max_blocks: int
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
            self.states[request.request_id] = RequestEviction(
                spec, request.num_prompt_tokens,
                spec.max_blocks(request.num_prompt_tokens, max_tokens, self.block_size))

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
        """Before vLLM schedules: compact due decode requests and free their tail blocks."""
        self.reserved_blocks = 0
        for request in scheduler.running:
            rid = request.request_id
            st = self.states.get(rid)
            if st is None:
                self.reserved_blocks += len(compat.request_blocks(scheduler, rid)) + 1
                continue
            self.reserved_blocks += st.max_blocks
            # only plain decode steps compact (not prefill chunks, not a recompute); under async
            # scheduling the newest token may still be a placeholder, its KV is written by the step in
            # flight, which the worker finishes before this step's compaction runs
            if rid in self.pending or rid in self.failed or not compat.is_plain_decode(request):
                continue
            sched = st.spec.schedule()
            physical = request.num_computed_tokens - st.offset
            if not sched.due(physical, request.num_computed_tokens - st.prompt_len, st.compacted):
                continue
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

    def admit(self, request) -> bool:
        """Reserve mode: a waiting compressed request fits only if every running bound still fits."""
        st = self.states.get(request.request_id)
        if st is None or self.cfg.admission != "reserve":
            return True
        return self.reserved_blocks + st.max_blocks <= self.pool_blocks

    def admitted(self, request) -> None:
        st = self.states.get(request.request_id)
        if st is not None:
            self.reserved_blocks += st.max_blocks

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
