"""Hole-filling compaction of many requests on a paged KV cache, in rows, on the cache's device.

Torch only (no vLLM import): it takes the per-layer cache tensors, the probed `PagedLayout` and the
step's rounds, so the same functions run in the engine's worker and in `kvtier bench compaction` on a
GPU machine without vLLM.

Rows: a backend stores each (block, KV head, slot) of K and of V as runs of contiguous elements (the
whole head_dim for FlashAttention's `[2, blocks, block_size, heads, d]`; shorter runs for tiled CPU
layouts). `RowLayout` finds the longest such run that tiles every token (a power of two dividing d) and
addresses the cache as a `[n_rows, chunk]` view, so a round copies one row index per run instead of one
int64 offset per element. A step's rounds share one index tensor per layer and one copy per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtier.policies import hole_fill_plan
from kvtier.policies.compaction import copy_rows

from .layout import PagedLayout


@dataclass
class RowLayout:
    """Where each (head, in-block slot) of K and V lives, as rows of `chunk` elements."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    chunk: int              # elements per row
    block_rows: int         # rows between block b and b + 1
    rows: Tensor            # [H, block_size, 2 * d / chunk] row indices in block 0: K's runs, then V's

    @classmethod
    def from_layout(cls, layout: PagedLayout, device=None) -> "RowLayout":
        d = layout.head_dim
        both = torch.cat([layout.k_offsets, layout.v_offsets], dim=2)            # [H, bs, 2d]
        chunk = d
        while chunk > 1:
            runs = both.view(*both.shape[:2], -1, chunk)
            start = runs[..., :1]
            if (bool((runs == start + torch.arange(chunk, device=runs.device)).all())
                    and bool((start % chunk == 0).all()) and layout.block_stride % chunk == 0):
                break
            chunk //= 2
        rows = both.view(*both.shape[:2], -1, chunk)[..., 0] // chunk
        return cls(layout.block_size, layout.num_kv_heads, d, chunk, layout.block_stride // chunk,
                   rows.to(device if device is not None else rows.device))

    def view(self, flat: Tensor) -> Tensor:
        """`flat` (PagedLayout.flat of a layer's cache) as [n_rows, chunk] rows (same storage)."""
        n = flat.numel() // self.chunk
        return flat.as_strided((n, self.chunk), (self.chunk, 1), flat.storage_offset())

    def token_rows(self, blocks: Tensor, heads: Tensor, slots: Tensor) -> Tensor:
        """[n, runs] row indices of K's then V's runs for n (block, head, in-block slot) triples."""
        return self.rows[heads, slots] + (blocks * self.block_rows).unsqueeze(-1)

    def to(self, device) -> "RowLayout":
        return RowLayout(self.block_size, self.num_kv_heads, self.head_dim, self.chunk, self.block_rows,
                         self.rows.to(device))


@dataclass
class Round:
    """One request's eviction round as the copy sees it (every tensor on the cache's device).

    blocks:  [nb] the request's block ids, covering its `old_len` cached entries.
    evicted: [L, H, e] slots evicted per (layer, KV head), ascending.
    """

    blocks: Tensor
    evicted: Tensor
    old_len: int

    @property
    def new_len(self) -> int:
        return self.old_len - self.evicted.shape[-1]


def round_moves(layout: RowLayout, rnd: Round) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hole filling for one round: (src_slots, dst_slots) [L, H, e] (survivors of the tail -> holes;
    filler pairs are dead-slot self copies, so shapes stay rectangular), and the (src, dst) row indices
    [L, H * e * runs] they mean in every layer."""
    L, H, e = rnd.evicted.shape
    plan = hole_fill_plan(rnd.evicted.reshape(L * H, e), rnd.old_len)
    src, dst = plan.src.view(L, H, e), plan.dst.view(L, H, e)
    moved = torch.where(dst < rnd.new_len, src, dst)
    heads = torch.arange(H, device=src.device).view(1, H, 1).expand(L, H, e)
    bs = layout.block_size
    src_rows = layout.token_rows(rnd.blocks[moved // bs], heads, moved % bs).reshape(L, -1)
    dst_rows = layout.token_rows(rnd.blocks[dst // bs], heads, dst % bs).reshape(L, -1)
    return src, dst, src_rows, dst_rows


def apply_rounds(layout: RowLayout, row_views: list[Tensor], rounds: list[Round]) -> list[tuple[Tensor, Tensor]]:
    """Compact every round of a step: one index tensor and one row copy per layer for all of them.
    Returns each round's (src_slots, dst_slots) [L, H, e], for the caller's slot maps."""
    moves = [round_moves(layout, r) for r in rounds]
    if not moves:
        return []
    src = torch.cat([m[2] for m in moves], dim=1)
    dst = torch.cat([m[3] for m in moves], dim=1)
    for li, rows in enumerate(row_views):
        copy_rows(rows, dst[li], src[li])
    return [(m[0], m[1]) for m in moves]


def gather_rows(layout: RowLayout, rows: Tensor, blocks: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values [H, n, d] of one layer at per-head slots [H, n] (blocks: the request's block ids)."""
    H, n = slots.shape
    heads = torch.arange(H, device=slots.device).view(H, 1).expand(H, n)
    bs = layout.block_size
    idx = layout.token_rows(blocks[slots // bs], heads, slots % bs)            # [H, n, runs]
    d = layout.head_dim
    kv = rows[idx.reshape(-1)].view(H, n, 2 * d)
    return kv[..., :d], kv[..., d:]


def to_device(values: list[int], device: torch.device) -> Tensor:
    """A long tensor on `device` from host values without a blocking copy: pinned host memory and a
    non-blocking transfer on CUDA (a tensor built from a list on a GPU waits for the forward in flight)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
