"""`random`'s keyed victims for many rounds of one request at once, on the host: the same numbers as
`kvtier.policies.keyed_random.keyed_victims` (its CPU path), computed faster.

The engines' draw (`keyed_subsets`) hashes in int64 with 16-bit halves (it must run on CUDA too) and picks
its k columns with a [rows, n] boolean and `nonzero`. Here the hash runs in numpy uint32, whose products
wrap mod 2^32 by definition (the halves are not needed), and the k first distinct draws of each row are
taken directly (k per row, then sorted), so no [rows, n] boolean is built. Rows with fewer than k distinct
draws (astronomically rare unless 4k > n) are handed to `keyed_subsets` itself, row by row independent, so
the result stays the engines' exactly (tests/test_deathtime_fast.py compares them over many shapes).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvtier.policies.keyed_random import fmix32, keyed_subsets, row_keys

_GOLDEN = 0x9E3779B9
_M32 = 0xFFFFFFFF


def _fmix32_u32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser in place on a uint32 array (equal to keyed_random.fmix32)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def counter_hashes(m: int) -> np.ndarray:
    """[m] uint32: fmix32((j + golden) mod 2^32) for j < m, the key-free half of `mix(key, j)`."""
    return fmix32((torch.arange(m) + _GOLDEN) & _M32).numpy().astype(np.uint32)


def keyed_victims_host(request_key: int, rounds: Tensor, layers: int, heads: Tensor, low: int,
                       num_candidates: int, num_evicted: int, *, counters: np.ndarray | None = None) -> Tensor:
    """[n, layers, len(heads), e] int64 victim slots, ascending, for n rounds (`rounds` [n], 1-based indices)
    of one request: equal to ``keyed_victims(tensor([request_key]).repeat(n), rounds, layers, heads,
    tensor([low]).repeat(n), num_candidates, num_evicted)`` on CPU. counters: `counter_hashes(2e + 16)`,
    passed by a caller that draws many chunks."""
    n, H, k = rounds.shape[0], heads.shape[0], num_evicted
    R = n * layers * H
    if k == 0 or R == 0:
        return torch.empty(n, layers, H, k, dtype=torch.long)
    m = 2 * k + 16
    keys = row_keys(torch.full((n,), int(request_key), dtype=torch.long), rounds.long(), layers, heads).reshape(R)
    c = counter_hashes(m) if counters is None else counters
    h = _fmix32_u32(keys.numpy().astype(np.uint32)[:, None] ^ c[None, :])                   # [R, m]
    span = max(num_candidates - low, 1)
    bits = (m - 1).bit_length()                   # (value, j) packed as value << bits | j: one sortable integer
    wide = np.int32 if span << bits < (1 << 31) else np.int64
    h64 = h.astype(np.uint64)
    h64 *= np.uint64(span)
    h64 >>= np.uint64(32)
    draws = h64.astype(wide)                                                                  # [R, m] in [0, span)
    # the first occurrence of each value in draw order: sort the packed pairs per row; within a run of equal
    # values every entry after the run's head has a later j (numpy sorts short integer rows with SIMD, several
    # times faster here than the engines' scatter over a [rows, span] table)
    pairs = draws << bits
    pairs |= np.arange(m, dtype=wide)
    pairs.sort(axis=1)
    value = pairs >> bits
    later = np.flatnonzero(value[:, 1:] == value[:, :-1])                 # flat indices into [R, m - 1]
    first = np.ones((R, m), dtype=bool)
    first.reshape(-1)[later // (m - 1) * m + (pairs[:, 1:].reshape(-1)[later] & ((1 << bits) - 1))] = False
    rank = first.cumsum(axis=1, dtype=np.int16 if m < (1 << 15) else np.int32)
    take = first & (rank <= k)
    short = rank[:, -1] < k
    if not short.any():
        out = draws[take].reshape(R, k)
        out.sort(axis=1)
        out = out.astype(np.int64)
    else:
        out = np.empty((R, k), dtype=np.int64)
        ok = ~short
        out[ok] = np.sort(draws[ok][take[ok]].reshape(-1, k), axis=1)
        rows = torch.from_numpy(np.flatnonzero(short))   # the engines' own fallback here (rows are independent)
        out[short] = keyed_subsets(keys[rows], torch.zeros(rows.numel(), dtype=torch.long),
                                   torch.full((rows.numel(),), span, dtype=torch.long), k, num_candidates,
                                   host_check=True).numpy()
    return torch.from_numpy(out + low).view(n, layers, H, k)
