"""Per-request worker state, and what policies reading queries or accumulated attention need from each
step's forward: a ring of recent post-RoPE queries per layer, and H2O's accumulated attention.

`queries`: the attention wrapper (`patches.ATTENTION_CAPTURE`) hands each layer's query/key to
`QueryCapture.capture`, which copies the rows `plan` prepared (ring indices on the device, computed on
the host from the step's bookkeeping: no device read). `attention` (H2O): a per-(layer, KV head, slot)
sum that moves with the slots at compaction and is recomputed in fp32 from the captured queries and
cached keys (see `kvtier.policies.h2o`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvtier.policies.h2o import accumulated_attention

from .paged_compaction import RowLayout, gather_rows


@dataclass
class WorkerRequest:
    key: int                           # 32-bit key of the request's counter-based draws (kvtier_seed or OS entropy)
    generator: torch.Generator         # for policies that sample with a torch generator (seeded from the key)
    positions: Tensor | None = None    # [layers, H, len] logical position held by each slot; None = chronological
    length: int = 0
    rounds: int = 0
    # Recent queries: a ring of w entries per layer, entry i of the stream at index i % w.
    queries: Tensor | None = None      # [layers, H_q, w, d] in the model dtype
    query_pos: Tensor | None = None    # [w] logical position of each ring entry (host)
    queries_seen: int = 0
    attention: Tensor | None = None    # [layers, H, capacity] float32; slots >= the cached length are 0
    pending: int = 0                   # newest ring entries whose attention is not yet in `attention`
    extras: dict = field(default_factory=dict)   # policies' own state across rounds (ctx.extras["state"])

    @property
    def window(self) -> int:
        return 0 if self.queries is None else self.queries.shape[2]

    def ring_tail(self, count: int, seen: int | None = None) -> Tensor:
        """Ring indices of the `count` newest entries (of the first `seen`), oldest first (host)."""
        seen = self.queries_seen if seen is None else seen
        return torch.arange(seen - count, seen) % self.window

    def recent_queries(self) -> Tensor:
        """[layers, H_q, n, d] the n = min(seen, w) newest queries, chronological."""
        idx = self.ring_tail(min(self.queries_seen, self.window)).to(self.queries.device)
        return self.queries[:, :, idx]

    def ensure_attention(self, layers: int, heads: int, length: int, device) -> Tensor:
        a = self.attention
        if a is None or a.shape[2] < length:
            cap = max(length, 2 * a.shape[2] if a is not None else 0)
            grown = torch.zeros(layers, heads, cap, dtype=torch.float32, device=device)
            if a is not None:
                grown[:, :, : a.shape[2]] = a
            self.attention = grown
        return self.attention

    def positions_at(self, old_len: int, query_position: int, layers: int, heads: int, device) -> Tensor:
        """The slot map at `old_len` entries: slots appended since the last round hold consecutive positions."""
        if self.positions is None:
            start = query_position - old_len + 1
            return torch.arange(start, start + old_len, device=device).expand(layers, heads, old_len).clone()
        pos = torch.empty(layers, heads, old_len, dtype=torch.long, device=device)
        pos[:, :, : self.length] = self.positions[:, :, : self.length]
        grown = old_len - self.length
        pos[:, :, self.length :] = torch.arange(query_position - grown + 1, query_position + 1, device=device)
        return pos

    def reset(self) -> None:
        """Preempted: vLLM recomputes every position; the recompute prefill re-adds all attention."""
        self.positions, self.length, self.pending = None, 0, 0
        if self.attention is not None:
            self.attention.zero_()


@dataclass
class CaptureRow:
    """What one request's scheduled tokens of this step do in the capture hook."""

    st: WorkerRequest
    start: int                          # rows [start, end) of the step's flattened tokens
    end: int
    write: Tensor                       # ring indices (device) for the last `write.numel()` tokens of the row
    flush: Tensor | None = None         # ring indices (device) of pending queries added now (H2O)
    flush_pos: Tensor | None = None     # their logical positions (device)
    cached_pos: Tensor | None = None    # [layers, H, n] slot map of the n entries cached before this step
    blocks: Tensor | None = None
    first_pos: int = 0                  # logical position of the row's first token


class QueryCapture:
    """Plans each step's query capture on the host and copies queries in each attention layer's forward."""

    def __init__(self, layout: RowLayout, row_views: list[Tensor], scales: list[float], device) -> None:
        self.layout, self.row_views, self.scales, self.device = layout, row_views, scales, device
        self.rows: list[CaptureRow] = []
        self.layers_done = 0

    def plan(self, todo, block_ids_of, offsets: dict[str, int]) -> None:
        """todo: (req_id, state, start, end, first logical position) for rows whose queries are kept.
        For H2O requests, if the ring would overwrite pending queries, they are added now (in the hook,
        together with this step's queries)."""
        L, H = len(self.row_views), self.layout.num_kv_heads
        rows = []
        for rid, st, start, end, first in todo:
            T, w = end - start, st.window
            keep = min(T, w)
            write = st.ring_tail(keep, st.queries_seen + T)
            cr = CaptureRow(st, start, end, write=write.to(self.device, non_blocking=True), first_pos=first)
            if st.attention is not None and st.pending + T > w:
                flush = st.ring_tail(st.pending)
                cr.flush, cr.flush_pos = flush.to(self.device), st.query_pos[flush].to(self.device)
                cached = first - offsets.get(rid, 0)      # physical entries cached before this step
                cr.cached_pos = st.positions_at(cached, first - 1, L, H, self.device)
                bs = self.layout.block_size
                cr.blocks = torch.tensor(block_ids_of(rid)[: -(-cached // bs)], dtype=torch.long).to(self.device)
                st.ensure_attention(L, H, cached + T, self.device)
                st.pending = 0
            elif st.attention is not None:
                st.pending += T
            st.query_pos[write] = torch.arange(end - keep, end) - start + first
            st.queries_seen += T
            rows.append(cr)
        self.rows, self.layers_done = rows, 0

    def capture(self, li: int, query: Tensor, key: Tensor | None) -> None:
        rows = self.rows
        self.layers_done += 1
        if self.layers_done >= len(self.row_views):
            self.rows = []  # consumed: a later forward without a prepared step captures nothing
        H, d = self.layout.num_kv_heads, self.layout.head_dim
        for cr in rows:
            st, T = cr.st, cr.end - cr.start
            q = query[cr.start : cr.end].reshape(T, -1, d).transpose(0, 1)             # [H_q, T, d]
            if cr.flush is not None and key is not None:
                self._add_attention_now(li, cr, q, key[cr.start : cr.end].reshape(T, H, d).transpose(0, 1))
            st.queries[li][:, cr.write] = q[:, T - cr.write.numel() :].to(st.queries.dtype)

    def _add_attention_now(self, li: int, cr: CaptureRow, q_new: Tensor, k_new: Tensor) -> None:
        """H2O, inside the step: the pending queries and this step's add their attention on the entries
        cached before the step plus this step's own keys (causal by logical position)."""
        st, T = cr.st, q_new.shape[1]
        H, n = self.layout.num_kv_heads, cr.cached_pos.shape[2]
        new_pos = torch.arange(cr.first_pos, cr.first_pos + T, device=self.device)
        k_old = gather_rows(self.layout, self.row_views[li], cr.blocks, torch.arange(n, device=self.device).expand(H, n))[0]
        keys = torch.cat([k_old, k_new.to(k_old.dtype)], dim=1)
        key_pos = torch.cat([cr.cached_pos[li], new_pos.expand(H, T)], dim=1)
        queries = torch.cat([st.queries[li][:, cr.flush], q_new.to(st.queries.dtype)], dim=1)
        query_pos = torch.cat([cr.flush_pos, new_pos])
        st.attention[li, :, : n + T] += accumulated_attention(keys, key_pos, queries, query_pos, self.scales[li])

    def add_attention_round(self, st: WorkerRequest, pos: Tensor, blocks: Tensor, old_len: int) -> None:
        """H2O, before selection: the queries since the last addition add their attention on every cached
        entry (candidates and buffer); nothing was evicted since they ran, so they saw exactly these."""
        L, H = len(self.row_views), self.layout.num_kv_heads
        acc = st.ensure_attention(L, H, old_len, self.device)
        if st.pending == 0 or st.queries is None:
            return
        idx = st.ring_tail(st.pending)
        qpos, idx = st.query_pos[idx].to(self.device), idx.to(self.device)
        slots = torch.arange(old_len, device=self.device).expand(H, old_len)
        for li in range(L):
            keys = gather_rows(self.layout, self.row_views[li], blocks, slots)[0]
            acc[li, :, :old_len] += accumulated_attention(keys, pos[li], st.queries[li][:, idx], qpos, self.scales[li])
        st.pending = 0
