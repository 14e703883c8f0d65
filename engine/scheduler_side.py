"""Scheduler-process half of the compressed engine (vLLM 0.31 V1 `Scheduler` / `KVCacheManager`).

It decides, before each `schedule()`, which running decode requests compact this step, moves their
logical/physical offset, and gives their emptied tail blocks back to the pool at once so this step's
allocations already see the memory. The worker half (`worker_side.py`) performs the copy at the start
of the same step. Everything the worker needs travels as one attribute on the `SchedulerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .payload import CompactionOp, StepPayload


@dataclass
class RequestEviction:
    spec: EvictionSpec
    prompt_len: int
    max_blocks: int
    offset: int = 0          # logical length - physical length
    rounds: int = 0


@dataclass
class SchedulerEviction:
    cfg: EngineEvictionConfig
    block_size: int
    pool_blocks: int
    states: dict[str, RequestEviction] = field(default_factory=dict)
    pending: dict[str, CompactionOp] = field(default_factory=dict)
    resets: dict[str, int] = field(default_factory=dict)
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
        self.pending.pop(request.request_id, None)
        # The recompute prefill samples its next token from the row num_tokens-1, with every position back.
        self.resets[request.request_id] = request.num_tokens - 1
        self.preempted_compressed += 1

    def on_free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.pending.pop(request_id, None)

    # -- per step ----------------------------------------------------------------------------
    def physical_len(self, request) -> int:
        st = self.states.get(request.request_id)
        return request.num_computed_tokens - (st.offset if st else 0)

    def plan(self, scheduler) -> None:
        """Before vLLM schedules: compact due decode requests and free their tail blocks."""
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        pool = scheduler.kv_cache_manager.block_pool
        self.reserved_blocks = 0
        for request in scheduler.running:
            rid = request.request_id
            st = self.states.get(rid)
            if st is None:
                self.reserved_blocks += len(manager.req_to_blocks.get(rid, ())) + 1
                continue
            self.reserved_blocks += st.max_blocks
            if request.num_computed_tokens != request.num_tokens - 1 or rid in self.pending:
                continue  # only plain decode steps compact (not prefill chunks, not spec decode)
            sched = st.spec.schedule()
            physical = request.num_computed_tokens - st.offset
            decoded = request.num_computed_tokens - st.prompt_len
            on_cadence = decoded > 0 and decoded % sched.buffer == 0
            if physical <= sched.settled_len or not (on_cadence or physical >= sched.max_cached):
                continue
            new_len = sched.settled_len
            keep_blocks = -(-new_len // self.block_size)
            blocks = manager.req_to_blocks[rid]
            tail = blocks[keep_blocks:]
            if tail:
                del blocks[keep_blocks:]
                if rid in manager.num_cached_block:
                    manager.num_cached_block[rid] = min(manager.num_cached_block[rid], keep_blocks)
                pool.free_blocks(reversed(tail))
                self.blocks_freed += len(tail)
            st.offset += physical - new_len
            st.rounds += 1
            self.pending[rid] = CompactionOp(
                req_id=rid, old_len=physical, new_len=new_len, keep_blocks=keep_blocks,
                prompt_len=st.prompt_len, spec=st.spec, round=st.rounds,
                query_position=request.num_computed_tokens - 1)

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

    def payload(self, scheduler_output) -> StepPayload:
        offsets = {rid: self.states[rid].offset for rid in scheduler_output.num_scheduled_tokens
                   if rid in self.states and self.states[rid].offset}
        p = StepPayload(ops=list(self.pending.values()), offsets=offsets, resets=dict(self.resets),
                        blocks_freed=self.blocks_freed, preempted_compressed=self.preempted_compressed)
        self.pending.clear()
        self.resets.clear()
        self.blocks_freed = self.preempted_compressed = 0
        return p


def is_waiting(request) -> bool:
    return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
