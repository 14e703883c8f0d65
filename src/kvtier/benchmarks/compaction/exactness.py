"""The compaction benchmark's exactness check (`exact`): after a step, for every (request, layer, head) the
entries in the first new_len slots, read back with `gather_rows` and matched to logical positions
through the updated slot map, are bit-identical to the pristine cache's entries at exactly the
positions that were not evicted (so the multisets of kept K and V rows are equal, and each row sits
where the slot map says).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvtier.engine.paged_compaction import gather_rows

if TYPE_CHECKING:
    from kvtier.benchmarks.compaction.cell import Cell


def check_step(cell: Cell, before: list[Tensor], evicted: list[Tensor], after_state: list[Tensor]) -> bool:
    """For every (request, layer, head): the first new_len slots hold, bit for bit, the pristine
    entries at exactly the positions not evicted (matched through the updated slot map)."""
    new_len = cell.settled
    ok = torch.zeros((), dtype=torch.bool, device=cell.device)
    ref_slots, got_slots = [], []
    for p0, ev, p1 in zip(before, evicted, after_state):
        kept = kept_slots(ev, cell.old_len)                                # [L, H, new_len]
        ref_pos = p0.gather(2, kept)
        o = ref_pos.argsort(dim=2)
        ref_pos, ref_slot = ref_pos.gather(2, o), kept.gather(2, o)
        got_pos, got_slot = p1[:, :, :new_len].sort(dim=2)
        if got_pos.shape != ref_pos.shape or not torch.equal(got_pos, ref_pos):
            return False
        ref_slots.append(ref_slot)
        got_slots.append(got_slot)
    scratch = torch.empty_like(cell.caches[0]) if cell.clones is None else None
    for li in range(cell.s.layers):
        ref_rows = cell.rows.view(cell.paged.flat(cell.pristine(li, scratch)))
        for i in range(cell.n):
            rk, rv = gather_rows(cell.rows, ref_rows, cell.blocks[i], ref_slots[i][li])
            gk, gv = gather_rows(cell.rows, cell.row_views[li], cell.blocks[i], got_slots[i][li])
            ok |= (_bits(rk) != _bits(gk)).any() | (_bits(rv) != _bits(gv)).any()
    return not bool(ok)


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def kept_slots(ev: Tensor, n: int) -> Tensor:
    """[L, H, n - e] ascending slots not in ev [L, H, e]."""
    L, H, e = ev.shape
    mask = torch.ones(L, H, n, dtype=torch.bool, device=ev.device)
    mask.scatter_(2, ev, False)
    return mask.nonzero()[:, 2].view(L, H, n - e)
