"""`random`'s death times of one sample, one compiled pass per (layer, head) row (`keyed_host.row_deaths`).

A row's rounds depend on nothing but its own keys (a round's key names its layer and head), so each row runs
its whole life at once, its slot -> position map (a few KB) and its deaths in cache: per round, the keyed draw
(the engines' numbers), the victims' deaths, then hole filling, the engines' compaction
(`kvtier.policies.compaction.hole_fill_plan`: the tail's survivors, ascending, into the victims' slots below
the new length, ascending). When no victim lies in the tail (always once e <= r: the r newest are never
candidates) the victim of rank q takes tail slot new_len + q, its rank a popcount of the draw's bitmap, so
the victims are never sorted. A row's deaths are kept as the round index of each entry's death (one byte for
< 255 rounds: the store's form, `store.encode`), expanded to death times only on the way out.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.policies.keyed_random import row_keys

from .keyed_host import check_draw, counter_hashes, index_rows, scratch, time_rows
from .store import index_dtype


def keyed_deaths(shapes: list[tuple[int, int, int, int]], *, request_key: int, rounds_before: int, layers: int,
                 heads: torch.Tensor, low: int, start: int, length: int, table: np.ndarray | None) -> np.ndarray:
    """[layers * len(heads), length]: each entry's round index (1-based, 0: never; the store's `index_dtype`), or
    with `table` ([rounds + 1]: what index 0, 1, ... stand for) table[index], of table's dtype.
    shapes: (query_position, cached, candidates, evicted) of each round (`simulate.round_shapes`); round i is
    keyed as the request's round rounds_before + i + 1, as in the engines; low: the protected slots."""
    R, rounds = layers * heads.shape[0], len(shapes)
    out = np.empty((R, length), dtype=index_dtype(rounds) if table is None else table.dtype)
    if rounds == 0:
        out.fill(0 if table is None else table[0])
        return out
    qp, n, n_cand, e = (np.ascontiguousarray(c, dtype=np.int64) for c in zip(*shapes))
    for c, k in zip(n_cand.tolist(), e.tolist()):
        if k:
            check_draw(low, c, k)
    keys = row_keys(torch.full((rounds,), int(request_key), dtype=torch.long),
                    torch.arange(1, rounds + 1) + int(rounds_before), layers, heads)
    keys = np.ascontiguousarray(keys.reshape(rounds, R).T.numpy().astype(np.uint32))            # [R, rounds]
    max_e = int(e.max())
    args = (keys, counter_hashes(2 * max_e + 16), qp, n, n_cand, e, int(low), int(start),
            scratch(max_e, max(int(n_cand.max()) - low, 1), max(int(n.max()), start)))
    if table is None:
        index_rows(*args, out)
    else:
        index = np.empty(length, dtype=np.uint32 if rounds >= 65535 else index_dtype(rounds))
        time_rows(*args, index, np.ascontiguousarray(table), out)
    return out
