"""Worker-process half of the compressed engine: per-KV-head compaction on vLLM's paged cache.

At the start of each step (before vLLM zeroes or appends blocks, since the scheduler may already have
handed a freed tail block to another request) every compaction due this step runs together: the policy
picks victims per (layer, KV head), survivors from the tail move into the holes (hole filling, at most
r entries per head), the request's block list and block-table row are cut to the blocks it still needs.
After vLLM prepares inputs, slot mapping and sequence lengths are rewritten to physical positions while
RoPE positions stay logical.

What a policy reads (`needs`) is gathered per layer at the round: keys, values and (when the policy takes
them, `optional`) the buffer's keys from the paged cache; `queries` from a per-request ring of recent
post-RoPE queries captured in each attention layer's forward (w = max(query_window, the policy's window),
bounded memory); `attention` (H2O) from a per-(layer, KV head, slot) sum that moves with the slots and is
recomputed from the captured queries and cached keys (see `kvtier.policies.h2o`); extras carry the layer
index and count (TriAttention's calibration comes with the request's params).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvtier.policies import EvictionContext, hole_fill_plan
from kvtier.policies.base import ATTENTION, BUFFER_KEYS, KEYS, QUERIES, VALUES
from kvtier.policies.h2o import accumulated_attention

from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .layout import PagedLayout, probe_layout
from .payload import PAYLOAD_ATTR, CompactionOp, StepPayload
from .stats import AuditLog, EvictionStats


@dataclass
class WorkerRequest:
    generator: torch.Generator
    positions: Tensor | None = None    # [layers, H, len] logical position held by each slot; None = chronological
    length: int = 0
    # Recent queries (policies reading queries or accumulated attention): a ring of w entries per layer,
    # entry i of the stream at index i % w.
    queries: Tensor | None = None      # [layers, H_q, w, d] in the model dtype
    query_pos: Tensor | None = None    # [w] logical position of each ring entry
    queries_seen: int = 0
    # Accumulated attention (H2O): per (layer, KV head, slot), moved with the slots by compaction.
    attention: Tensor | None = None    # [layers, H, capacity] float32; slots >= the cached length are 0
    pending: int = 0                   # newest ring entries whose attention is not yet in `attention`
    extras: dict = field(default_factory=dict)

    @property
    def window(self) -> int:
        return 0 if self.queries is None else self.queries.shape[2]

    def ring_tail(self, count: int, seen: int | None = None) -> Tensor:
        """Ring indices of the `count` newest entries (of the first `seen`), oldest first."""
        seen = self.queries_seen if seen is None else seen
        return torch.arange(seen - count, seen) % self.window

    def recent_queries(self, layer: int) -> Tensor:
        """[H_q, n, d] the n = min(seen, w) newest queries of one layer, chronological."""
        return self.queries[layer][:, self.ring_tail(min(self.queries_seen, self.window))]

    def ensure_attention(self, layers: int, heads: int, length: int, device) -> Tensor:
        a = self.attention
        if a is None or a.shape[2] < length:
            cap = max(length, 2 * a.shape[2] if a is not None else 0)
            grown = torch.zeros(layers, heads, cap, dtype=torch.float32, device=device)
            if a is not None:
                grown[:, :, : a.shape[2]] = a
            self.attention = grown
        return self.attention

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


@dataclass
class CaptureRow:
    """What one request's scheduled tokens of this step do in the query-capture hook."""

    row: int
    st: WorkerRequest
    start: int                  # rows [start, end) of the step's flattened tokens
    end: int
    write: Tensor               # ring indices for the last `write.numel()` tokens of the row
    flush: Tensor | None = None         # ring indices of pending queries to add now with the row's (H2O)
    flush_pos: Tensor | None = None     # their logical positions
    cached_pos: Tensor | None = None    # [layers, H, n] slot map of the n entries cached before this step
    blocks: Tensor | None = None
    first_pos: int = 0                  # logical position of the row's first token


def query_window(cfg: EngineEvictionConfig, spec: EvictionSpec) -> int:
    """Ring size for a request: the engine's query_window, the policy's own `window`, and for policies
    reading accumulated attention at least r (the queries between two rounds)."""
    policy = spec.make_policy()
    w = max(cfg.query_window, int(getattr(policy, "window", 0) or 0))
    if ATTENTION in policy.needs:
        w = max(w, spec.buffer)
    return w


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
        # The softmax scale each attention layer's kernel uses (H2O recomputes the kernel's weights).
        self.scales = [float(getattr(layer.impl, "scale", self.head_dim ** -0.5)) for layer in self.layers]
        caches = [layer.kv_cache if isinstance(layer.kv_cache, Tensor) else layer.kv_cache[0] for layer in self.layers]
        self.device, self.dtype = caches[0].device, caches[0].dtype   # queries are kept as the model computed them
        self.layout: PagedLayout = probe_layout(
            caches[0], runner.kv_cache_config.num_blocks, self.num_kv_heads, self.block_size, self.head_dim,
            lambda k, v, cache, slots: self.layers[0].impl.do_kv_cache_update(self.layers[0], k, v, cache, slots))
        self.flats = [self.layout.flat(c) for c in caches]
        self.requests: dict[str, WorkerRequest] = {}
        self.stats = EvictionStats()
        self.audit = AuditLog(cfg.audit_log) if cfg.audit_log else None
        self.batch_req_ids: list[str] = []
        self.capture_rows: list[CaptureRow] = []   # this step's rows whose queries are kept
        self.captured_layers = 0                    # layers of this step's forward captured so far
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
                # Preempted: vLLM recomputes every position; the recompute prefill re-adds all attention.
                st.pending = 0
                if st.attention is not None:
                    st.attention.zero_()
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
        """Plan this step's query capture, then rewrite slot mapping and seq_lens to physical positions
        (RoPE positions stay logical)."""
        runner = self.runner
        req_ids = runner.input_batch.req_ids[:num_reqs]
        self.batch_req_ids = list(req_ids)
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        self.query_start_loc = qsl.tolist()
        payload: StepPayload | None = getattr(scheduler_output, PAYLOAD_ATTR, None)
        offsets_of = payload.offsets if payload is not None else {}
        self.capture_rows = self._plan_capture(req_ids, offsets_of)
        self.captured_layers = 0
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

    # -- query capture (policies that read recent queries or accumulated attention) -----------
    def _on_new_request(self, req_id: str, sampling_params) -> None:
        if sampling_params is None:
            return
        spec = resolve_request_spec(self.cfg.default, sampling_params.extra_args)
        if not spec.compressed:
            return
        needs = spec.make_policy().needs
        if not needs & {QUERIES, ATTENTION}:
            return
        st = self._state(req_id, spec.seed)
        if st.queries is None:
            w = query_window(self.cfg, spec)
            st.queries = torch.zeros(len(self.layers), self.num_q_heads, w, self.head_dim, dtype=self.dtype,
                                     device=self.device)
            st.query_pos = torch.full((w,), -1, dtype=torch.long)
        if ATTENTION in needs and st.attention is None:
            st.ensure_attention(len(self.layers), self.num_kv_heads, 0, self.device)

    def _plan_capture(self, req_ids, offsets: dict[str, int]) -> list[CaptureRow]:
        """Ring bookkeeping for this step (the hook only copies): which ring entries the new queries take,
        and for H2O requests whether the pending queries must be added now because the ring would
        overwrite them (then they are added in the hook together with this step's queries)."""
        rows = []
        qsl = self.query_start_loc
        L, H = len(self.layers), self.num_kv_heads
        todo = [(i, rid, self.requests[rid]) for i, rid in enumerate(req_ids)
                if rid in self.requests and self.requests[rid].queries is not None and qsl[i + 1] > qsl[i]]
        if not todo:
            return rows
        firsts = self.runner.positions[torch.tensor([qsl[i] for i, _, _ in todo])].tolist()  # logical, one read
        for (i, rid, st), first in zip(todo, firsts):
            start, end = qsl[i], qsl[i + 1]
            T = end - start
            w = st.window
            keep = min(T, w)
            cr = CaptureRow(i, st, start, end, write=st.ring_tail(keep, st.queries_seen + T), first_pos=first)
            if st.attention is not None and st.pending + T > w:
                cr.flush = st.ring_tail(st.pending)
                cr.flush_pos = st.query_pos[cr.flush].clone()
                cached = first - offsets.get(rid, 0)      # physical entries cached before this step
                cr.cached_pos = st.positions_at(cached, first - 1, L, H)
                block_ids = self.runner.requests[rid].block_ids[0]
                cr.blocks = torch.tensor(block_ids[: -(-cached // self.block_size)], dtype=torch.long)
                st.ensure_attention(L, H, cached + T, self.device)
                st.pending = 0
            elif st.attention is not None:
                st.pending += T
            st.query_pos[cr.write] = torch.arange(end - keep, end) - start + first
            st.queries_seen += T
            rows.append(cr)
        return rows

    def install_query_capture(self) -> None:
        """Wrap each attention layer's impl.forward (instance attribute) to keep recent post-RoPE queries."""
        for name, layer in zip(self.layer_names, self.layers):
            impl = layer.impl
            if getattr(impl.forward, "__kvtier_capture__", False):
                continue
            original = impl.forward

            def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, _orig=original, _name=name, **kw):
                if self.capture_rows and attn_metadata is not None:
                    self.capture(_name, query, key)
                return _orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kw)

            forward.__kvtier_capture__ = True
            impl.forward = forward

    def capture(self, layer_name: str, query: Tensor, key: Tensor | None = None) -> None:
        li = self.layer_index.get(layer_name)
        if li is None:
            return
        rows = self.capture_rows
        self.captured_layers += 1
        if self.captured_layers >= len(self.layers):
            self.capture_rows = []  # consumed: a later forward without a prepared step captures nothing
        H, d = self.num_kv_heads, self.head_dim
        for cr in rows:
            st = cr.st
            T = cr.end - cr.start
            q = query[cr.start : cr.end].reshape(T, -1, d).transpose(0, 1)             # [H_q, T, d]
            if cr.flush is not None and key is not None:
                self._add_attention_now(li, cr, q, key[cr.start : cr.end].reshape(T, H, d).transpose(0, 1))
            st.queries[li][:, cr.write] = q[:, T - cr.write.numel() :]

    def _add_attention_now(self, li: int, cr: CaptureRow, q_new: Tensor, k_new: Tensor) -> None:
        """H2O, inside the step: the pending queries and this step's add their attention on the entries
        cached before the step plus this step's own keys (causal by logical position)."""
        st, T = cr.st, q_new.shape[1]
        H, n = self.num_kv_heads, cr.cached_pos.shape[2]
        new_pos = torch.arange(cr.first_pos, cr.first_pos + T)
        k_old = self._gather_slots(li, cr.blocks, torch.arange(n).expand(H, n))[0]
        keys = torch.cat([k_old, k_new.to(k_old.dtype)], dim=1)
        key_pos = torch.cat([cr.cached_pos[li], new_pos.expand(H, T)], dim=1)
        queries = torch.cat([st.queries[li][:, cr.flush], q_new.to(st.queries.dtype)], dim=1)
        query_pos = torch.cat([cr.flush_pos, new_pos])
        st.attention[li, :, : n + T] += accumulated_attention(keys, key_pos, queries, query_pos, self.scales[li])

    # -- compaction ---------------------------------------------------------------------------
    def _gather_slots(self, li: int, blocks: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [H, n, d] of one layer at the given per-head slots [H, n]."""
        H, d = self.num_kv_heads, self.head_dim
        n = slots.shape[1]
        flat = slots.reshape(-1)
        heads = torch.arange(H).repeat_interleave(n)
        off = self.layout.token_offsets(blocks[flat // self.block_size], heads, flat % self.block_size)
        kv = self.flats[li][off].view(H, n, 2 * d)
        return kv[..., :d], kv[..., d:]

    def _add_attention_round(self, st: WorkerRequest, pos: Tensor, blocks: Tensor, old_len: int) -> None:
        """H2O, before selection: the queries since the last addition add their attention on every cached
        entry (candidates and buffer); nothing was evicted since they ran, so they saw exactly these."""
        L, H = len(self.layers), self.num_kv_heads
        acc = st.ensure_attention(L, H, old_len, self.device)
        if st.pending == 0 or st.queries is None:
            return
        idx = st.ring_tail(st.pending)
        qpos = st.query_pos[idx]
        slots = torch.arange(old_len).expand(H, old_len)
        for li in range(L):
            keys = self._gather_slots(li, blocks, slots)[0]
            acc[li, :, :old_len] += accumulated_attention(keys, pos[li], st.queries[li][:, idx], qpos, self.scales[li])
        st.pending = 0

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
        needs = policy.needs | (getattr(policy, "optional", frozenset()) & {BUFFER_KEYS})
        buffer_slots = torch.arange(n_cand, op.old_len).expand(H, op.old_len - n_cand)
        out = []
        for li in range(L):
            order = cand[li].argsort(dim=1)                      # chronological candidate order per head
            got: dict = {}
            if needs & {KEYS, VALUES, BUFFER_KEYS}:
                with_buffer = BUFFER_KEYS in needs
                k, v = self._gather_slots(li, blocks, torch.cat([order, buffer_slots], 1) if with_buffer else order)
                got[KEYS], got[VALUES] = k[:, :n_cand], v[:, :n_cand]
                if with_buffer:
                    got[BUFFER_KEYS] = k[:, n_cand:]
            if QUERIES in needs and st.queries is not None:
                got[QUERIES] = st.recent_queries(li)
            if ATTENTION in needs:
                acc = st.attention[li, :, :n_cand] if st.attention is not None else torch.zeros(H, n_cand, device=self.device)
                got[ATTENTION] = acc.gather(1, order.to(acc.device))
            ctx = EvictionContext(positions=cand[li].gather(1, order), extras={"layer": li, "num_layers": L},
                                  **{k: v for k, v in got.items() if k in needs}, **base)
            ev = order.gather(1, policy.evict(ctx).to(order.device))
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
            if st.attention is not None:
                self._add_attention_round(st, pos, blocks, op.old_len)
            evicted = self._select(op, st, pos, blocks)                      # [L, H, e]
            e = evicted.shape[-1]
            plan = hole_fill_plan(evicted.reshape(L * H, e), op.old_len)
            src, dst = plan.src.view(L, H, e), plan.dst.view(L, H, e)
            # Filler pairs (dead tail slot -> dead tail slot) become self-copies of their dead slot: shapes
            # stay rectangular for every layer at once, and the copy is a no-op.
            moved = torch.where(dst < op.new_len, src, dst).reshape(-1)
            heads = torch.arange(H).view(1, H, 1).expand(L, H, e).reshape(-1)
            flat_dst = dst.reshape(-1)
            s_off = self.layout.token_offsets(blocks[moved // bs], heads, moved % bs).view(L, -1)
            d_off = self.layout.token_offsets(blocks[flat_dst // bs], heads, flat_dst % bs).view(L, -1)
            for li in range(L):
                src_off[li].append(s_off[li])
                dst_off[li].append(d_off[li])
            # slot map (and H2O's accumulated attention): survivors from the tail take the holes
            pos.scatter_(2, dst, pos.gather(2, src))
            st.positions, st.length = pos[:, :, : op.new_len].contiguous(), op.new_len
            if st.attention is not None:
                acc = st.attention[:, :, : op.old_len]
                s_, d2 = src.to(acc.device), dst.to(acc.device)
                acc.scatter_(2, d2, acc.gather(2, s_))
                st.attention[:, :, op.new_len :] = 0                         # freed slots start at 0
            self._truncate_blocks(op, req_state)
            self.stats.record_round(op.req_id, op.spec.policy, e)
            if self.audit is not None:
                kept = st.positions.sort(dim=2).values[:, :, : op.new_len - op.spec.buffer]
                self.audit.write(req_id=op.req_id, round=op.round, query_position=op.query_position,
                                 prompt_len=op.prompt_len, budget=op.spec.budget, buffer=op.spec.buffer,
                                 policy=op.spec.policy, kept=kept.tolist())
        for li in range(L):
            if src_off[li]:
                s, d_ = torch.cat(src_off[li]), torch.cat(dst_off[li])
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
