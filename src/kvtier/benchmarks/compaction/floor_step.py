"""The floor of the compaction benchmark: a full per-head gather compaction (`full_gather_plan`, what the
paper's engine pays every round) of the same requests, keeping the K + r survivors in chronological
order in slots 0..K+r-1 through the same paged row copies (victims drawn untimed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvtier.benchmarks.compaction.batched_step import select_keyed
from kvtier.benchmarks.compaction.exactness import kept_slots
from kvtier.policies import full_gather_plan, make_policy
from kvtier.policies.compaction import copy_rows

if TYPE_CHECKING:
    from kvtier.benchmarks.compaction.cell import Cell

# the floor's row indices are built for groups of requests of at most this many bytes (one group when
# they fit: a layout with one-element rows has 2d int64 indices per entry, 2.5 GB per request at K=2048)
FLOOR_INDEX_BYTES = {"cpu": 1 << 30, "cuda": 8 << 30}


def floor_keep(cell: Cell, pos: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """(keep, evicted) slots per request for the floor (untimed): random victims; the K survivors in
    chronological order, then the buffer, as the paper's engine gathers them."""
    evicted = select_keyed(cell, make_policy("random"))
    keep = []
    for p, ev in zip(pos, evicted):
        kept = kept_slots(ev, cell.old_len)                                # [L, H, K + r] ascending slots
        keep.append(kept.gather(2, p.gather(2, kept).argsort(dim=2)))
    return keep, evicted


def floor_step(cell: Cell, keep: list[Tensor], pos: list[Tensor]) -> None:
    """The timed floor: full_gather_plan per request, the same paged row copies (one per layer for
    every request), slot maps gathered."""
    L, H, bs = cell.s.layers, cell.s.kv_heads, cell.s.block_size
    heads = cell.heads.view(1, H, 1)
    # requests share one copy per layer, in groups whose row indices stay under FLOOR_INDEX_BYTES
    per_req = L * H * cell.settled * (2 * cell.s.head_dim // cell.rows.chunk) * 8 * 2
    group = max(1, FLOOR_INDEX_BYTES[cell.device.type] // per_req)
    for g0 in range(0, cell.n, group):
        srcs, dsts = [], []
        for blocks, kp in zip(cell.blocks[g0:g0 + group], keep[g0:g0 + group]):
            plan = full_gather_plan(kp.reshape(L * H, -1), cell.old_len)
            src, dst = plan.src.view(L, H, -1), plan.dst.view(L, H, -1)
            hh = heads.expand_as(src)
            srcs.append(cell.rows.token_rows(blocks[src // bs], hh, src % bs).reshape(L, -1))
            dsts.append(cell.rows.token_rows(blocks[dst // bs], hh, dst % bs).reshape(L, -1))
        src, dst = torch.cat(srcs, dim=1), torch.cat(dsts, dim=1)
        for li, rows in enumerate(cell.row_views):
            copy_rows(rows, dst[li], src[li])
        del srcs, dsts, src, dst
    for j, kp in enumerate(keep):
        new = pos[j].gather(2, kp)
        pos[j][:, :, : new.shape[2]] = new
    cell.advance(pos)
