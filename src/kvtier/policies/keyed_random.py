"""Counter-based random numbers: a value is a hash of (row key, counter), not a generator's state.

The engine draws victims for every (request, layer, KV head) row due in a step in one call. A torch
Generator is one stream, so a batched draw from it would depend on which other requests happened to be
due; here each row's numbers depend only on its key: (request seed, round, layer, global KV head). So a
request's keep-sets are reproducible from `kvtier_seed` whatever it is batched with, and tensor-parallel
ranks, which hold different heads, draw independently. Integer ops only, identical on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x, c < 2^32 without leaving int64 (split x in 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def mix(key: Tensor, value: Tensor | int) -> Tensor:
    """A new 32-bit key from a key and a value (both < 2^32)."""
    return fmix32(key ^ fmix32((torch.as_tensor(value, device=key.device) + 0x9E3779B9) & _M32))


def seed_key(seed: int) -> int:
    """A 32-bit key from any Python int seed (both halves of a 64-bit seed count)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    k = fmix32(torch.tensor(s & _M32)) ^ fmix32(torch.tensor((s >> 32) ^ 0x5BD1E995))
    return int(fmix32(k))


def row_keys(request_keys: Tensor, rounds: Tensor, layers: int, heads: Tensor) -> Tensor:
    """[n, layers, len(heads)] keys for n requests: request_keys/rounds [n] int64, heads = the global KV
    head index of each local head (tensor parallelism: rank * local_heads + h)."""
    k = mix(request_keys, rounds)                                              # [n]
    k = mix(k.view(-1, 1), torch.arange(layers, device=k.device).view(1, -1))  # [n, L]
    return mix(k.unsqueeze(-1), heads.view(1, 1, -1))                         # [n, L, H]


def uniform_u32(keys: Tensor, counters: Tensor) -> Tensor:
    """keys [R] x counters [m] -> [R, m] uniform integers in [0, 2^32)."""
    return mix(keys.view(-1, 1), counters.view(1, -1))


def keyed_subsets(keys: Tensor, low: Tensor, high: Tensor, k: int, n: int, *, host_check: bool | None = None,
                  short_out: list | None = None) -> Tensor:
    """[R, k] ascending per row: a uniformly random k-subset of range(low[r], high[r]), a function of keys[r].
    `n` >= max(high - low), known to the caller (no device read).

    Draws 2k + 16 integers per row and keeps the first k distinct ones in draw order (the procedure
    commutes with relabelling, so every k-subset is equally likely); rows with too few distinct draws
    take the k smallest of one keyed score per candidate. When 4k > n that fallback is computed for every
    row (a static choice). Otherwise a short row is astronomically rare (fewer than k distinct values in
    2k + 16 uniform draws from >= 4k), and how it is found depends on `host_check` (default: on CPU):

    * host_check: one read of `short.any()` decides whether to compute the fallback (free on a CPU);
    * no host check (a GPU step must not wait for the forward in flight): nothing is read; the rows'
      short flags [R] are appended to `short_out` for the caller to read later, off the critical path,
      and a short row's result is then wrong (valid indices, but fewer than k distinct), never out of range.
    """
    R, dev = keys.shape[0], keys.device
    if k == 0 or R == 0:
        return torch.empty(R, 0, dtype=torch.long, device=dev)
    if host_check is None:
        host_check = dev.type == "cpu"
    span = (high - low).view(R, 1)
    m = 2 * k + 16
    j = torch.arange(m, device=dev).expand(R, m)
    draws = (uniform_u32(keys, j[0]) * span) >> 32                                   # [R, m] in [0, span)
    first_at = torch.full((R, n), m, dtype=torch.long, device=dev)
    first_at.scatter_reduce_(1, draws, j, reduce="amin")
    first = first_at.gather(1, draws) == j
    rank = first.cumsum(dim=1)
    # duplicates of a value all point at one column: send the not-taken ones to a spare column n instead
    chosen = torch.zeros(R, n + 1, dtype=torch.bool, device=dev)
    chosen.scatter_(1, torch.where(first & (rank <= k), draws, n), True)
    chosen = chosen[:, :n]
    short = rank[:, -1] < k
    if 4 * k > n or (host_check and bool(short.any())):
        cand = torch.arange(n, device=dev).expand(R, n)
        score = uniform_u32(keys, torch.arange(m, m + n, device=dev)).masked_fill(cand >= span, 1 << 33)
        pick = torch.zeros(R, n, dtype=torch.bool, device=dev).scatter_(1, score.topk(k, dim=1, largest=False).indices, True)
        chosen = torch.where(short.view(R, 1), pick, chosen)
    elif short_out is not None:
        short_out.append(short)
    if host_check:
        return chosen.nonzero()[:, 1].view(R, k) + low.view(R, 1)
    # the k chosen columns of each row, ascending, without nonzero() (a host read of its size); slots a
    # short row leaves unset keep column 0 (in range)
    slot = torch.where(chosen, chosen.cumsum(dim=1) - 1, k)
    out = torch.zeros(R, k + 1, dtype=torch.long, device=dev)
    out.scatter_(1, slot, torch.arange(n, device=dev).expand(R, n))
    return out[:, :k] + low.view(R, 1)


def keyed_victims(request_keys: Tensor, rounds: Tensor, layers: int, heads: Tensor, low: Tensor,
                  num_candidates: int, num_evicted: int, *, host_check: bool | None = None,
                  short_out: list | None = None) -> Tensor:
    """`random`'s victims for n rounds of requests at once: [n, layers, len(heads), e] candidate slots,
    ascending, drawn uniformly from [low[i], num_candidates) per (layer, head) row. Slots below low (the
    protected prefix) come first in a hole-filling cache, so slot ranges are what random draws from. The
    vLLM engine's worker and the reference engine both call this: same seed, same keep-sets."""
    n, H = request_keys.shape[0], heads.shape[0]
    keys = row_keys(request_keys, rounds, layers, heads).reshape(-1)
    lows = low.repeat_interleave(layers * H)
    out = keyed_subsets(keys, lows, torch.full_like(lows, num_candidates), num_evicted, num_candidates,
                        host_check=host_check, short_out=short_out)
    return out.view(n, layers, H, num_evicted)
