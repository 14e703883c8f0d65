"""The reference engine's KV cache: dense per-layer tensors, one row per sequence, per-KV-head slots.

Slots are physical, positions logical (as in the vLLM engine's paged cache after compaction); a round
compacts by hole filling (`kvtier.policies.hole_fill_plan`), so every entry keeps its post-RoPE key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtier.policies import hole_fill_plan


class BatchKVCache:
    """Per-layer dense caches for B sequences, per KV head: keys[l], values[l]: [B, H, cap, d];
    positions: [L, B, H, cap] logical position held by each slot (-1 = empty); lengths [B] physical
    entries per head (every head of a sequence holds the same count). Optional per-slot state moves with
    its entry: accumulated attention (H2O) and a ring of the w most recent post-RoPE queries per layer."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, *, q_heads: int,
                 dtype=torch.float32, device="cpu", track_attention: bool = False, query_window: int = 0):
        self.L, self.B, self.H, self.d, self.cap, self.Hq = layers, batch, kv_heads, head_dim, capacity, q_heads
        self.device = torch.device(device)
        self.keys = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
                     for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.positions = torch.full((layers, batch, kv_heads, capacity), -1, dtype=torch.long, device=device)
        self.lengths = [0] * batch
        self.attention = ([torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=device)
                           for _ in range(layers)] if track_attention else None)
        self.query_window = query_window
        self.queries = ([torch.zeros(batch, q_heads, query_window, head_dim, dtype=torch.float32, device=device)
                         for _ in range(layers)] if query_window else None)

    def bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.keys + self.values) + self.positions.numel() * 8
        return n

    def kept_positions(self, b: int, buffer: int) -> Tensor:
        """[L, H, n - r] logical positions held outside the buffer, ascending."""
        n = self.lengths[b]
        return self.positions[:, b, :, :n].sort(dim=-1).values[:, :, : max(n - buffer, 0)]

    def apply_round(self, rows: list[int], evicted: Tensor) -> int:
        """evicted: [L, len(rows), H, e] slots (ascending per head) of sequences that all hold n entries.
        Hole filling: surviving tail entries move into the holes. Returns the new length."""
        L, nb, H, e = evicted.shape
        n = self.lengths[rows[0]]
        dev = self.device
        b_idx = torch.tensor(rows, device=dev).repeat_interleave(H).unsqueeze(1).expand(nb * H, e)
        h_idx = torch.arange(H, device=dev).repeat(nb).unsqueeze(1).expand(nb * H, e)
        new_len = n - e
        for l in range(L):
            plan = hole_fill_plan(evicted[l].reshape(nb * H, e).to(dev), n)
            src, dst = plan.src, plan.dst
            for t in (self.keys[l], self.values[l], self.positions[l]) + (
                    (self.attention[l],) if self.attention is not None else ()):
                t[b_idx, h_idx, dst] = t[b_idx, h_idx, src]
        rows_t = torch.tensor(rows, device=dev)
        self.positions[:, rows_t, :, new_len:n] = -1
        if self.attention is not None:
            for l in range(L):
                self.attention[l][rows_t, :, new_len:n] = 0
        for b in rows:
            self.lengths[b] = new_len
        return new_len
