"""Worker-process half of the compressed engine: per-KV-head compaction on vLLM's paged cache.

At the start of each step (before vLLM zeroes or appends blocks, since the scheduler may already have
handed a freed tail block to another request) every compaction due this step runs together: the policy
picks victims per (layer, KV head), survivors from the tail move into the holes (hole filling, at most
r entries per head), the request's block list and block-table row are cut to the blocks it still needs.
After vLLM prepares inputs, slot mapping and sequence lengths are rewritten to physical positions while
RoPE positions stay logical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvtier.policies import EvictionContext, hole_fill_plan

from .config import EngineEvictionConfig, resolve_request_spec
from .layout import PagedLayout, probe_layout
from .payload import PAYLOAD_ATTR, CompactionOp, StepPayload
from .stats import AuditLog, EvictionStats


@dataclass
class WorkerRequest:
    generator: torch.Generator
    positions: Tensor | None = None    # [layers, H, len] logical position held by each slot; None = chronological
    length: int = 0
    queries: Tensor | None = None      # [layers, H_q, w, d] most recent queries (query-reading policies only)
    queries_seen: int = 0
    extras: dict = field(default_factory=dict)

    def positions_at(self, old_len: int, query_position: int, layers: int, heads: int) -> Tensor:
        """The slot map at `old_len` entries: slots appended since the last round hold consecutive positions."""
        if self.positions is None:
            pos = torch.arange(query_position - old_len + 1, query_position + 1).expand(layers, heads, old_len).clone()
        else:
            pos = torch.empty(layers, heads, old_len, dtype=torch.long)
            pos[:, :, : self.length] = self.positions[:, :, : self.length]
            grown = old_len - self.length
            pos[:, :, self.length :] = torch.arange(query_position - grown + 1, query_position + 1)
        return pos


class WorkerEviction:
    def __init__(self, runner, cfg: EngineEvictionConfig) -> None:
        self.runner = runner
        self.cfg = cfg
        group = runner.kv_cache_config.kv_cache_groups[0]
        ctx = runner.compilation_config.static_forward_context
        self.layer_names = list(group.layer_names)
        self.layers = [ctx[name] for name in self.layer_names]
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        spec = group.kv_cache_spec
        self.block_size, self.num_kv_heads, self.head_dim = spec.block_size, spec.num_kv_heads, spec.head_size
        self.num_q_heads = runner.model_config.get_num_attention_heads(runner.parallel_config)
        caches = [layer.kv_cache if isinstance(layer.kv_cache, Tensor) else layer.kv_cache[0] for layer in self.layers]
        self.layout: PagedLayout = probe_layout(
            caches[0], runner.kv_cache_config.num_blocks, self.num_kv_heads, self.block_size, self.head_dim,
            lambda k, v, cache, slots: self.layers[0].impl.do_kv_cache_update(self.layers[0], k, v, cache, slots))
        self.flats = [self.layout.flat(c) for c in caches]
        self.requests: dict[str, WorkerRequest] = {}
        self.stats = EvictionStats()
        self.audit = AuditLog(cfg.audit_log) if cfg.audit_log else None
        self.batch_req_ids: list[str] = []
        self.capture_rows: list[tuple[int, str]] = []   # (batch row, req id) whose queries are kept
        self.query_start_loc: list[int] = []

    # -- request state ------------------------------------------------------------------------
    def _state(self, req_id: str, seed: int | None) -> WorkerRequest:
        st = self.requests.get(req_id)
        if st is None:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else torch.seed())
            st = self.requests[req_id] = WorkerRequest(gen)
        return st

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.requests.pop(rid, None)

    # -- step hooks ---------------------------------------------------------------------------
    def before_update_states(self, scheduler_output) -> None:
        payload: StepPayload | None = getattr(scheduler_output, PAYLOAD_ATTR, None)
        if payload is None:
            return
        for rid, row in payload.resets.items():
            st = self.requests.get(rid)
            if st is not None:
                st.positions, st.length = None, 0
            self.stats.request(rid).preemptions += 1
            if self.audit is not None:
                self.audit.write(req_id=rid, reset_row=row)
        self.stats.engine.blocks_freed += payload.blocks_freed
        self.stats.engine.preemptions_compressed += payload.preempted_compressed
        if payload.ops:
            t0 = time.perf_counter()
            self._compact(payload.ops)
            self.stats.observe_round_ms((time.perf_counter() - t0) * 1e3)
            self.stats.engine.steps_with_eviction += 1

    def after_update_states(self, scheduler_output) -> None:
        self.forget(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            self._on_new_request(new.req_id, new.sampling_params)
        for rid, req_state in self.runner.requests.items():
            if rid in scheduler_output.num_scheduled_tokens and rid in self.requests:
                rc = self.stats.request(rid)
                rc.peak_blocks = max(rc.peak_blocks, len(req_state.block_ids[0]))

    def after_prepare_inputs(self, scheduler_output, num_reqs: int) -> None:
        """Rewrite slot mapping and seq_lens to physical positions (RoPE positions stay logical)."""
        runner = self.runner
        req_ids = runner.input_batch.req_ids[:num_reqs]
        self.batch_req_ids = list(req_ids)
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        self.query_start_loc = qsl.tolist()
        self.capture_rows = [(i, r) for i, r in enumerate(req_ids) if r in self.requests and self.requests[r].queries is not None]
        payload: StepPayload | None = getattr(scheduler_output, PAYLOAD_ATTR, None)
        if payload is None or not payload.offsets:
            return
        offsets = torch.tensor([payload.offsets.get(r, 0) for r in req_ids], dtype=torch.int64)
        if not offsets.any():
            return
        total = int(qsl[num_reqs])
        counts = torch.from_numpy(qsl[1 : num_reqs + 1] - qsl[:num_reqs]).to(torch.int64)
        physical = runner.positions[:total] - offsets.repeat_interleave(counts)
        runner.input_batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical)
        runner.seq_lens[:num_reqs] -= offsets.to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= offsets.to(runner.optimistic_seq_lens_cpu.dtype)

    # -- query capture (policies that read recent queries) ------------------------------------
    def _on_new_request(self, req_id: str, sampling_params) -> None:
        if sampling_params is None:
            return
        spec = resolve_request_spec(self.cfg.default, sampling_params.extra_args)
        if spec.compressed and "queries" in spec.make_policy().needs:
            st = self._state(req_id, spec.seed)
            if st.queries is None:
                st.queries = torch.zeros(len(self.layers), self.num_q_heads, self.cfg.query_window,
                                         self.head_dim, dtype=torch.float32)

    def install_query_capture(self) -> None:
        """Wrap each attention layer's impl.forward (instance attribute) to keep recent post-RoPE queries."""
        for name, layer in zip(self.layer_names, self.layers):
            impl = layer.impl
            if getattr(impl.forward, "__kvtier_capture__", False):
                continue
            original = impl.forward

            def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _orig=original, _name=name, **kw):
                if self.capture_rows and attn_metadata is not None:
                    self.capture(_name, query)
                return _orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kw)

            forward.__kvtier_capture__ = True
            impl.forward = forward

    def capture(self, layer_name: str, query: Tensor) -> None:
        li = self.layer_index.get(layer_name)
        if li is None:
            return
        w = self.cfg.query_window
        for row, rid in self.capture_rows:
            st = self.requests.get(rid)
            if st is None or st.queries is None:
                continue
            start, end = self.query_start_loc[row], self.query_start_loc[row + 1]
            q = query[max(start, end - w) : end].float()          # [t, H_q, d]
            t = q.shape[0]
            buf = st.queries[li]
            buf[:, : w - t] = buf[:, t:].clone()
            buf[:, w - t :] = q.view(t, buf.shape[0], self.head_dim).transpose(0, 1)
            if li == 0:
                st.queries_seen += t

    # -- compaction ---------------------------------------------------------------------------
    def _candidates(self, li: int, blocks: Tensor, n_cand: int, order: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [H, n_cand, d] of the candidates of one layer, in the given per-head slot order."""
        H, d = self.num_kv_heads, self.head_dim
        slots = order.reshape(-1)
        heads = torch.arange(H).repeat_interleave(n_cand)
        off = self.layout.token_offsets(blocks[slots // self.block_size], heads, slots % self.block_size)
        kv = self.flats[li][off].view(H, n_cand, 2 * d)
        return kv[..., :d], kv[..., d:]

    def _select(self, op: CompactionOp, st: WorkerRequest, pos: Tensor, blocks: Tensor) -> Tensor:
        """Evicted slots [layers, H, e], ascending per head."""
        policy, sched = op.spec.make_policy(), op.spec.schedule()
        L, H = len(self.layers), self.num_kv_heads
        n_cand = sched.num_candidates(op.old_len)
        cand = pos[:, :, :n_cand]
        base = dict(budget=sched.budget, prompt_len=op.prompt_len, generator=st.generator,
                    query_position=op.query_position)
        if policy.order_free and not policy.needs:   # one draw for every layer and head
            ev = policy.evict(EvictionContext(positions=cand.reshape(L * H, n_cand), **base))
            return ev.view(L, H, -1)
        out = []
        for li in range(L):
            order = cand[li].argsort(dim=1)                      # chronological candidate order per head
            keys = values = None
            if {"keys", "values"} & policy.needs:
                keys, values = self._candidates(li, blocks, n_cand, order)
            queries = st.queries[li] if st.queries is not None else None
            ctx = EvictionContext(positions=cand[li].gather(1, order), keys=keys, values=values, queries=queries,
                                  extras={"layer": li, "num_layers": L}, **base)
            ev = order.gather(1, policy.evict(ctx))
            out.append(ev.sort(dim=1).values)
        return torch.stack(out)

    def _compact(self, ops: list[CompactionOp]) -> None:
        runner, bs = self.runner, self.block_size
        L, H = len(self.layers), self.num_kv_heads
        src_off: list[list[Tensor]] = [[] for _ in range(L)]
        dst_off: list[list[Tensor]] = [[] for _ in range(L)]
        for op in ops:
            req_state = runner.requests.get(op.req_id)
            if req_state is None:
                continue
            block_ids = req_state.block_ids[0]
            blocks = torch.tensor(block_ids[: -(-op.old_len // bs)], dtype=torch.long)
            st = self._state(op.req_id, op.spec.seed)
            pos = st.positions_at(op.old_len, op.query_position, L, H)
            evicted = self._select(op, st, pos, blocks)                      # [L, H, e]
            e = evicted.shape[-1]
            plan = hole_fill_plan(evicted.reshape(L * H, e), op.old_len)
            src, dst = plan.src.view(L, H, e), plan.dst.view(L, H, e)
            real = dst < op.new_len                                          # drop dead->dead filler pairs
            heads = torch.arange(H).view(1, H, 1).expand(L, H, e)
            for li in range(L):
                m = real[li]
                s, d_, h = src[li][m], dst[li][m], heads[li][m]
                src_off[li].append(self.layout.token_offsets(blocks[s // bs], h, s % bs))
                dst_off[li].append(self.layout.token_offsets(blocks[d_ // bs], h, d_ % bs))
            # slot map: survivors from the tail take the holes
            pos.scatter_(2, dst, pos.gather(2, src))
            st.positions, st.length = pos[:, :, : op.new_len].contiguous(), op.new_len
            self._truncate_blocks(op, req_state)
            rc = self.stats.request(op.req_id)
            rc.events += 1
            rc.tokens_evicted += e
            self.stats.engine.events += 1
            self.stats.engine.tokens_evicted += e
            if self.audit is not None:
                kept = st.positions.sort(dim=2).values[:, :, : op.new_len - op.spec.buffer]
                self.audit.write(req_id=op.req_id, round=op.round, query_position=op.query_position,
                                 prompt_len=op.prompt_len, budget=op.spec.budget, buffer=op.spec.buffer,
                                 policy=op.spec.policy, kept=kept.tolist())
        for li in range(L):
            if src_off[li]:
                s, d_ = torch.cat(src_off[li]).reshape(-1), torch.cat(dst_off[li]).reshape(-1)
                flat = self.flats[li]
                flat.index_copy_(0, d_, flat.index_select(0, s))

    def _truncate_blocks(self, op: CompactionOp, req_state) -> None:
        """Cut the request's block list and its persistent block-table row to `keep_blocks` (the scheduler
        already returned the tail to the pool; rows are append-only in vLLM, so shorten them here)."""
        for ids in req_state.block_ids:
            del ids[op.keep_blocks :]
        row = self.runner.input_batch.req_id_to_index.get(op.req_id)
        if row is None:
            return
        for bt in self.runner.input_batch.block_table.block_tables:
            n = op.keep_blocks * bt.blocks_per_kv_block
            old = int(bt.num_blocks_per_row[row])
            if old > n:
                bt.block_table.np[row, n:old] = 0
                bt.num_blocks_per_row[row] = n
