"""kvtier's arm of the compaction benchmark: one engine step's compaction of every due request, as the
compressed engine's worker does it (`src/kvtier/engine/worker_side.py`, selection in
`victim_selection.py`).

Victim selection for every due request exactly as the worker calls it (`random`: one counter-based
draw, `keyed_random.row_keys` + `keyed_subsets`, for every (request, layer, head) row; scored policies:
per request, candidates' keys/values (and the buffer's keys) gathered with `gather_rows` for all
layers, layers stacked as rows, one `policy.evict` call), then `apply_rounds` for all requests (one row
copy per layer) and the slot-map update (`pos.scatter_(2, dst, pos.gather(2, src))`, then the settled
map is kept).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvtier.engine.paged_compaction import Round, apply_rounds, gather_rows, to_device
from kvtier.policies import EvictionContext
from kvtier.policies.base import ATTENTION, BUFFER_KEYS, KEYS, QUERIES, VALUES
from kvtier.policies.keyed_random import keyed_subsets, row_keys
from kvtier.policies.random import RandomPolicy

if TYPE_CHECKING:
    from kvtier.benchmarks.compaction.cell import Cell

# as src/kvtier/engine/victim_selection.py: policies whose scores depend on the layer are called once per layer
PER_LAYER_POLICIES = frozenset({"triattention", "diverse"})


def select_keyed(cell: Cell, policy) -> list[Tensor]:
    """WorkerEviction._select_keyed for n rounds of one (candidates, victims) group."""
    L, H, e = cell.s.layers, cell.s.kv_heads, cell.old_len - cell.settled
    keys = row_keys(to_device(cell.keys, cell.device), to_device([cell.round] * cell.n, cell.device), L,
                    cell.heads).reshape(-1)
    low = to_device([policy.protected_len(cell.s.prompt_len)] * cell.n, cell.device).repeat_interleave(L * H)
    high = torch.full_like(low, cell.n_cand)
    victims = keyed_subsets(keys, low, high, e, cell.n_cand).view(cell.n, L, H, e)
    return [victims[j] for j in range(cell.n)]


def select_one(cell: Cell, name: str, policy, i: int, pos: Tensor) -> Tensor:
    """WorkerEviction._select_one: evicted slots [L, H, e], ascending per head."""
    L, H, n_cand, old_len = cell.s.layers, cell.s.kv_heads, cell.n_cand, cell.old_len
    cand = pos[:, :, :n_cand]
    base = dict(budget=cell.budget, prompt_len=cell.s.prompt_len, generator=cell.generators[i],
                query_position=cell.query_position)
    if policy.order_free and not policy.needs:
        return policy.evict(EvictionContext(positions=cand.reshape(L * H, n_cand), **base)).view(L, H, -1)
    needs = policy.needs | (getattr(policy, "optional", frozenset()) & {BUFFER_KEYS})
    order = cand.argsort(dim=2)
    buffer_slots = torch.arange(n_cand, old_len, device=cell.device).expand(H, old_len - n_cand)
    blocks = cell.blocks[i]
    got: dict = {}
    if needs & {KEYS, VALUES, BUFFER_KEYS}:
        with_buffer = BUFFER_KEYS in needs
        kv = [gather_rows(cell.rows, cell.row_views[li], blocks,
                          torch.cat([order[li], buffer_slots], 1) if with_buffer else order[li]) for li in range(L)]
        k, v = torch.stack([x[0] for x in kv]), torch.stack([x[1] for x in kv])
        got[KEYS], got[VALUES] = k[:, :, :n_cand], v[:, :, :n_cand]
        if with_buffer:
            got[BUFFER_KEYS] = k[:, :, n_cand:]
    if QUERIES in needs:
        w = cell.s.query_window
        got[QUERIES] = cell.queries[i][:, :, torch.arange(w, device=cell.device)]   # the ring read
    if ATTENTION in needs:
        got[ATTENTION] = torch.zeros(L, H, n_cand, device=cell.device)
    got = {k: v for k, v in got.items() if k in needs}
    chrono = cand.gather(2, order)
    if name in PER_LAYER_POLICIES:
        ev = torch.stack([policy.evict(EvictionContext(positions=chrono[li], extras={"layer": li, "num_layers": L},
                                                       **{k: v[li] for k, v in got.items()}, **base))
                          for li in range(L)])
    else:
        stacked = {k: v.reshape(L * v.shape[1], *v.shape[2:]) for k, v in got.items()}
        ev = policy.evict(EvictionContext(positions=chrono.reshape(L * H, n_cand), extras={"num_layers": L},
                                          **stacked, **base)).view(L, H, -1)
    return order.gather(2, ev).sort(dim=2).values


def batched_step(cell: Cell, name: str, policy, pos: list[Tensor]) -> list[Tensor]:
    """The timed engine step: selection for every request, apply_rounds for all, slot-map update.
    Returns the evicted slots per request; `pos` is updated in place."""
    if type(policy) is RandomPolicy:
        evicted = select_keyed(cell, policy)
    else:
        evicted = [select_one(cell, name, policy, i, p) for i, p in enumerate(pos)]
    moves = apply_rounds(cell.rows, cell.row_views, [Round(b, ev, cell.old_len) for b, ev in zip(cell.blocks, evicted)])
    for p, (src, dst) in zip(pos, moves):
        p.scatter_(2, dst, p.gather(2, src))
    cell.advance(pos)
    return evicted
