"""`kvtier bench compaction`: one engine step's compaction of every due request on a paged KV cache.

What the compressed engine's worker does at the start of a step where `n` requests are due a round
(`src/kvtier/engine/worker_side.py`), reproduced without vLLM on the torch-only pieces it uses:

* a paged cache per layer in a backend's own layout, probed through that backend's cache-update op
  (`kvtier.engine.layout.probe_layout`) and addressed as rows (`kvtier.engine.paged_compaction.RowLayout`):
  `flash` = FlashAttention's `[2, blocks, block_size, kv_heads, d]`; `cpu` = vLLM 0.31's CPU backend
  page `[blocks, kv_heads, block_size, 2*d]`, written with vLLM's own `cpu_attn_reshape_and_cache` when
  vLLM is importable and supports the shape, else with a torch emulation of the same element order
  (the `vec`/`vec16` ISAs store K *transposed*, `[d, block_size]` per (block, head), then V as
  `[block_size, d]`: rows of one element); `cpu_plain` = the same page with K stored like V
  (`[block_size, d]`), the layout one would assume from the view in `do_kv_cache_update`;
* every due request holds old_len = K + 2r entries per (layer, KV head) in blocks drawn at random from a
  pool sized for exactly these requests; a steady-state slot map (prompt in the first slots, older
  generated positions in a per-head random order, the r-entry buffer last and chronological);
* the timed step: victim selection for every due request exactly as the worker calls it (`random`: one
  counter-based draw, `keyed_random.row_keys` + `keyed_subsets`, for every (request, layer, head) row;
  scored policies: per request, candidates' keys/values (and the buffer's keys) gathered with
  `gather_rows` for all layers, layers stacked as rows, one `policy.evict` call), then `apply_rounds`
  for all requests (one row copy per layer) and the slot-map update (`pos.scatter_(2, dst,
  pos.gather(2, src))`, then the settled map is kept);
* the floor, measured the same way: a full per-head gather compaction (`full_gather_plan`, what the
  paper's engine pays every round) of the same requests, keeping the K + r survivors in chronological
  order in slots 0..K+r-1 through the same paged row copies (victims drawn untimed);
* `exact`: after the first step from the pristine cache (which also serves as warm-up), for every
  (request, layer, head) the entries in the first new_len slots, read back with `gather_rows` and
  matched to logical positions through the updated slot map, are bit-identical to the pristine
  cache's entries at exactly the positions that were not evicted (so the multisets of kept K and V
  rows are equal, and each row sits where the slot map says).

Timings are the median of `repeats` steps after that warm-up (host wall time around a synchronised
step: the worker blocks on it); between steps the buffer is re-armed untimed as `positions_at` does.
Cells whose cache exceeds the memory cap are listed under `skipped`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from kvtier.engine.layout import PagedLayout, probe_layout
from kvtier.engine.paged_compaction import Round, RowLayout, apply_rounds, gather_rows
from kvtier.policies import EvictionContext, EvictionSchedule, full_gather_plan, make_policy
from kvtier.policies.base import ATTENTION, BUFFER_KEYS, KEYS, QUERIES, VALUES
from kvtier.policies.compaction import copy_rows
from kvtier.policies.keyed_random import keyed_subsets, row_keys, seed_key
from kvtier.policies.random import RandomPolicy

LAYOUTS = ("flash", "cpu", "cpu_plain")
TARGETS = {"random_ratio_to_floor_max": 0.25, "h200_ms_per_request_at_2048_max": 0.5}
# as src/kvtier/engine/worker_side.py: policies whose scores depend on the layer are called once per layer
PER_LAYER_POLICIES = frozenset({"triattention", "diverse"})
# the floor's row indices are built for groups of requests of at most this many bytes (one group when
# they fit: a layout with one-element rows has 2d int64 indices per entry, 2.5 GB per request at K=2048)
FLOOR_INDEX_BYTES = {"cpu": 1 << 30, "cuda": 8 << 30}


@dataclass(frozen=True)
class CompactionShapes:
    """Qwen3-4B by default."""

    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    buffer: int = 64
    query_heads: int = 32
    prompt_len: int = 64
    query_window: int = 8          # the engine's default query_window (snapkv/rkv read the last 8 queries)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- cache layouts ------------------------------------------------------------------------------------

def cache_shape(layout: str, num_blocks: int, s: CompactionShapes) -> tuple[int, ...]:
    if layout == "flash":
        return (2, num_blocks, s.block_size, s.kv_heads, s.head_dim)
    if layout in ("cpu", "cpu_plain"):
        return (num_blocks, s.kv_heads, s.block_size, 2 * s.head_dim)
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def flash_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """FlashAttention's reshape_and_cache_flash: K and V planes of [blocks, block_size, H, d]."""
    H, d = k.shape[1], k.shape[2]
    cache[0].view(-1, H, d)[slots] = k
    cache[1].view(-1, H, d)[slots] = v


def cpu_vec_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """vLLM 0.31's CPU `vec`/`vec16` page: per (block, head) K as [d, block_size] (transposed), then V
    as [block_size, d] (what `cpu_attn_reshape_and_cache` writes; the layout probe checks it)."""
    nb, H, bs, two_d = cache.shape
    d = two_d // 2
    page = cache.view(nb, H, 2 * bs * d)
    kt = page[:, :, : bs * d].view(nb, H, d, bs).permute(0, 3, 1, 2)     # [nb, bs, H, d] view
    vv = page[:, :, bs * d :].view(nb, H, bs, d).permute(0, 2, 1, 3)
    kt[slots // bs, slots % bs] = k
    vv[slots // bs, slots % bs] = v


def cpu_plain_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """The CPU page read naively: key_cache[b, h, s, :], value_cache[b, h, s, :] after
    `kv_cache.view(blocks, H, 2 * block_size, d).chunk(2, dim=2)`."""
    nb, H, bs, two_d = cache.shape
    kc, vc = cache.view(nb, H, 2 * bs, two_d // 2).chunk(2, dim=2)
    kc.permute(0, 2, 1, 3)[slots // bs, slots % bs] = k
    vc.permute(0, 2, 1, 3)[slots // bs, slots % bs] = v


def vllm_cpu_writer(s: CompactionShapes, dtype: torch.dtype):
    """(writer, isa) through vLLM's own CPU cache-update op, as CPUAttentionBackendImpl.do_kv_cache_update
    calls it; raises ImportError without vLLM."""
    from vllm import _custom_ops as ops
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(dtype, s.block_size, s.head_dim, "auto")
    except Exception:  # noqa: BLE001 - same rule, for a vLLM whose backend module does not import here
        isa = "vec16" if (s.head_dim % 32 and not s.head_dim % 16) or s.block_size % 32 else "vec"

    def write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
        nb, H, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, H, bs * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    return write, isa


@dataclass
class LayoutWriter:
    """A layout's cache-update op (torch emulation or vLLM's own) and what was found about it."""

    name: str
    writer: str
    write: Callable[[Tensor, Tensor, Tensor, Tensor], None]
    info: dict = field(default_factory=dict)

    def probe(self, cache: Tensor, num_blocks: int, s: CompactionShapes) -> tuple[PagedLayout, RowLayout]:
        """Probe the layout of `cache` (a pool of num_blocks) through the op, as the engine's worker does."""
        paged = probe_layout(cache, num_blocks, s.kv_heads, s.block_size, s.head_dim, self.write)
        return paged, RowLayout.from_layout(paged, cache.device)


def layout_writer(name: str, s: CompactionShapes, device: torch.device, dtype: torch.dtype,
                  cpu_writer: str = "auto") -> LayoutWriter:
    """cpu_writer (layout `cpu` only): auto = vLLM's op when vLLM imports and its kernels take the shape
    (on a CPU device), else the emulation; vllm = vLLM's op or an error; emulated."""
    if name == "flash":
        return LayoutWriter(name, "emulated", flash_write)
    if name == "cpu_plain":
        return LayoutWriter(name, "emulated", cpu_plain_write)
    if name != "cpu":
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    info: dict = {}
    if cpu_writer == "vllm" or (cpu_writer == "auto" and device.type == "cpu"):
        try:
            fn, isa = vllm_cpu_writer(s, dtype)
            nb = _pool_size(3, name, s)
            cache = torch.empty(cache_shape(name, nb, s), dtype=dtype, device=device)
            real = probe_layout(cache, nb, s.kv_heads, s.block_size, s.head_dim, fn)
            emul = probe_layout(cache, nb, s.kv_heads, s.block_size, s.head_dim, cpu_vec_write)
            info["emulation_matches_vllm"] = bool(torch.equal(real.k_offsets, emul.k_offsets)
                                                  and torch.equal(real.v_offsets, emul.v_offsets))
            return LayoutWriter(name, f"vllm:cpu_attn_reshape_and_cache(isa={isa})", fn, info)
        except Exception as exc:  # noqa: BLE001 - no vLLM, or a shape its kernels do not take
            if cpu_writer == "vllm":
                raise
            msg = str(exc).strip().splitlines()
            info["vllm_unavailable"] = f"{type(exc).__name__}: {msg[0][:160] if msg else ''}"
    return LayoutWriter(name, "emulated", cpu_vec_write, info)


def _pool_size(blocks: int, layout: str, s: CompactionShapes) -> int:
    """`blocks`, plus spare blocks while another cache dimension before the block one has that size
    (probe_layout takes the first dimension of size num_blocks as the block dimension)."""
    shape = cache_shape(layout, 10**9, s)
    while blocks in shape[: shape.index(10**9)]:
        blocks += 1
    return blocks


# -- one cell: n due requests at budget K -------------------------------------------------------------

def cache_bytes(requests: int, budget: int, s: CompactionShapes, dtype: torch.dtype) -> int:
    blocks = -(-(budget + 2 * s.buffer) // s.block_size)
    return requests * blocks * s.block_size * s.layers * s.kv_heads * s.head_dim * 2 * torch.empty((), dtype=dtype).element_size()


class Cell:
    """The paged caches, slot maps and request state of `requests` requests due a round at budget K."""

    def __init__(self, writer: LayoutWriter, budget: int, requests: int, s: CompactionShapes, *,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 pristine: str | None = None) -> None:
        self.writer, self.s = writer, s
        self.budget, self.n, self.device, self.dtype, self.seed = budget, requests, device, dtype, seed
        self.sched = EvictionSchedule(budget=budget, buffer=s.buffer)
        self.old_len = budget + 2 * s.buffer
        self.settled = self.sched.settled_len
        self.n_cand = self.sched.num_candidates(self.old_len)
        self.blocks_per_req = -(-self.old_len // s.block_size)
        self.num_blocks = _pool_size(requests * self.blocks_per_req, writer.name, s)   # exact unless ambiguous
        # pristine content: a clone (fast restore; twice the memory) or regenerated per layer from a seed
        self.pristine_mode = pristine or ("regenerate" if device.type == "cuda" else "clone")
        shape = cache_shape(writer.name, self.num_blocks, s)
        self.caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(s.layers)]
        self.paged, self.rows = writer.probe(self.caches[0], self.num_blocks, s)
        for li in range(s.layers):
            self._fill(li, self.caches[li])
        self.clones = [c.clone() for c in self.caches] if self.pristine_mode == "clone" else None
        self.row_views = [self.rows.view(self.paged.flat(c)) for c in self.caches]
        g = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=g)
        self.blocks = [perm[i * self.blocks_per_req:(i + 1) * self.blocks_per_req].to(device) for i in range(requests)]
        self.heads = torch.arange(s.kv_heads, device=device)   # global KV heads (one rank)
        self.keys = [seed_key(seed * 100_003 + i) for i in range(requests)]
        self.generators = []
        for i in range(requests):
            gen = torch.Generator(device=device)
            gen.manual_seed(self.keys[i] * 65521)
            self.generators.append(gen)
        qg = torch.Generator(device=device).manual_seed(seed + 1)
        self.queries = [torch.randn(s.layers, s.query_heads, s.query_window, s.head_dim, generator=qg, device=device,
                                    dtype=torch.float32).to(dtype) for _ in range(requests)]
        self._initial_positions()

    def _fill(self, li: int, out: Tensor) -> Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + li)
        return out.normal_(generator=gen)

    def pristine(self, li: int, scratch: Tensor | None = None) -> Tensor:
        """Layer li's cache as it was before any step (scratch: a same-shaped buffer for regeneration)."""
        if self.clones is not None:
            return self.clones[li]
        return self._fill(li, scratch if scratch is not None else torch.empty_like(self.caches[0]))

    def _initial_positions(self) -> None:
        """Steady state after earlier rounds: prompt in slots [0, P), older generated positions in a
        random order per head in [P, K + r), newest r appended as the step arrives."""
        s, L, H = self.s, self.s.layers, self.s.kv_heads
        P, n_old = s.prompt_len, self.settled - s.prompt_len
        g = torch.Generator(device=self.device).manual_seed(self.seed + 2)
        self.state = []
        for _ in range(self.n):
            perm = torch.rand(L * H, n_old, generator=g, device=self.device).argsort(dim=1)
            jitter = torch.randint(0, 3, (L * H, n_old), generator=g, device=self.device)
            held = P + 3 * perm + jitter                       # distinct, scattered over 3x the span
            prompt = torch.arange(P, device=self.device).expand(L * H, P)
            self.state.append(torch.cat([prompt, held], dim=1).view(L, H, self.settled).contiguous())
        self.query_position = P + 3 * n_old + self.s.buffer   # newest position once the buffer is full
        self.round = 1

    def restore(self) -> None:
        """Back to the pristine cache and slot maps (untimed)."""
        for li, c in enumerate(self.caches):
            if self.clones is not None:
                c.copy_(self.clones[li])
            else:
                self._fill(li, c)
        self._initial_positions()

    def rearm(self) -> list[Tensor]:
        """The slot maps at old_len entries (engine: WorkerRequest.positions_at): settled + r new slots."""
        L, H, r = self.s.layers, self.s.kv_heads, self.s.buffer
        out = []
        for st in self.state:
            pos = torch.empty(L, H, self.old_len, dtype=torch.long, device=self.device)
            pos[:, :, : self.settled] = st
            pos[:, :, self.settled :] = torch.arange(self.query_position - r + 1, self.query_position + 1, device=self.device)
            out.append(pos)
        return out

    def advance(self, pos: list[Tensor]) -> None:
        self.state = [p[:, :, : self.settled].contiguous() for p in pos]
        self.query_position += self.s.buffer
        self.round += 1

    # -- selection, as src/kvtier/engine/worker_side.py -----------------------------------------------
    def select_keyed(self, policy) -> list[Tensor]:
        """WorkerEviction._select_keyed for n rounds of one (candidates, victims) group."""
        L, H, e = self.s.layers, self.s.kv_heads, self.old_len - self.settled
        keys = row_keys(torch.tensor(self.keys, device=self.device),
                        torch.tensor([self.round] * self.n, device=self.device), L, self.heads).reshape(-1)
        low = torch.tensor([policy.protected_len(self.s.prompt_len)] * self.n, device=self.device).repeat_interleave(L * H)
        high = torch.full_like(low, self.n_cand)
        victims = keyed_subsets(keys, low, high, e, self.n_cand).view(self.n, L, H, e)
        return [victims[j] for j in range(self.n)]

    def select_one(self, name: str, policy, i: int, pos: Tensor) -> Tensor:
        """WorkerEviction._select_one: evicted slots [L, H, e], ascending per head."""
        L, H, n_cand, old_len = self.s.layers, self.s.kv_heads, self.n_cand, self.old_len
        cand = pos[:, :, :n_cand]
        base = dict(budget=self.budget, prompt_len=self.s.prompt_len, generator=self.generators[i],
                    query_position=self.query_position)
        if policy.order_free and not policy.needs:
            return policy.evict(EvictionContext(positions=cand.reshape(L * H, n_cand), **base)).view(L, H, -1)
        needs = policy.needs | (getattr(policy, "optional", frozenset()) & {BUFFER_KEYS})
        order = cand.argsort(dim=2)
        buffer_slots = torch.arange(n_cand, old_len, device=self.device).expand(H, old_len - n_cand)
        blocks = self.blocks[i]
        got: dict = {}
        if needs & {KEYS, VALUES, BUFFER_KEYS}:
            with_buffer = BUFFER_KEYS in needs
            kv = [gather_rows(self.rows, self.row_views[li], blocks,
                              torch.cat([order[li], buffer_slots], 1) if with_buffer else order[li]) for li in range(L)]
            k, v = torch.stack([x[0] for x in kv]), torch.stack([x[1] for x in kv])
            got[KEYS], got[VALUES] = k[:, :, :n_cand], v[:, :, :n_cand]
            if with_buffer:
                got[BUFFER_KEYS] = k[:, :, n_cand:]
        if QUERIES in needs:
            w = self.s.query_window
            got[QUERIES] = self.queries[i][:, :, torch.arange(w, device=self.device)]   # the ring read
        if ATTENTION in needs:
            got[ATTENTION] = torch.zeros(L, H, n_cand, device=self.device)
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

    def step(self, name: str, policy, pos: list[Tensor]) -> list[Tensor]:
        """The timed engine step: selection for every request, apply_rounds for all, slot-map update.
        Returns the evicted slots per request; `pos` is updated in place."""
        if type(policy) is RandomPolicy:
            evicted = self.select_keyed(policy)
        else:
            evicted = [self.select_one(name, policy, i, p) for i, p in enumerate(pos)]
        moves = apply_rounds(self.rows, self.row_views, [Round(b, ev, self.old_len) for b, ev in zip(self.blocks, evicted)])
        for p, (src, dst) in zip(pos, moves):
            p.scatter_(2, dst, p.gather(2, src))
        self.advance(pos)
        return evicted

    # -- the floor: full per-head gather ------------------------------------------------------------
    def floor_keep(self, pos: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """(keep, evicted) slots per request for the floor (untimed): random victims; the K survivors in
        chronological order, then the buffer, as the paper's engine gathers them."""
        evicted = self.select_keyed(make_policy("random"))
        keep = []
        for p, ev in zip(pos, evicted):
            kept = _complement(ev, self.old_len)                                # [L, H, K + r] ascending slots
            keep.append(kept.gather(2, p.gather(2, kept).argsort(dim=2)))
        return keep, evicted

    def floor_step(self, keep: list[Tensor], pos: list[Tensor]) -> None:
        """The timed floor: full_gather_plan per request, the same paged row copies (one per layer for
        every request), slot maps gathered."""
        L, H, bs = self.s.layers, self.s.kv_heads, self.s.block_size
        heads = self.heads.view(1, H, 1)
        # requests share one copy per layer, in groups whose row indices stay under FLOOR_INDEX_BYTES
        per_req = L * H * self.settled * (2 * self.s.head_dim // self.rows.chunk) * 8 * 2
        group = max(1, FLOOR_INDEX_BYTES[self.device.type] // per_req)
        for g0 in range(0, self.n, group):
            srcs, dsts = [], []
            for blocks, kp in zip(self.blocks[g0:g0 + group], keep[g0:g0 + group]):
                plan = full_gather_plan(kp.reshape(L * H, -1), self.old_len)
                src, dst = plan.src.view(L, H, -1), plan.dst.view(L, H, -1)
                hh = heads.expand_as(src)
                srcs.append(self.rows.token_rows(blocks[src // bs], hh, src % bs).reshape(L, -1))
                dsts.append(self.rows.token_rows(blocks[dst // bs], hh, dst % bs).reshape(L, -1))
            src, dst = torch.cat(srcs, dim=1), torch.cat(dsts, dim=1)
            for li, rows in enumerate(self.row_views):
                copy_rows(rows, dst[li], src[li])
            del srcs, dsts, src, dst
        for j, kp in enumerate(keep):
            new = pos[j].gather(2, kp)
            pos[j][:, :, : new.shape[2]] = new
        self.advance(pos)

    # -- exactness ------------------------------------------------------------------------------
    def check(self, before: list[Tensor], evicted: list[Tensor], after_state: list[Tensor]) -> bool:
        """For every (request, layer, head): the first new_len slots hold, bit for bit, the pristine
        entries at exactly the positions not evicted (matched through the updated slot map)."""
        new_len = self.settled
        ok = torch.zeros((), dtype=torch.bool, device=self.device)
        ref_slots, got_slots = [], []
        for p0, ev, p1 in zip(before, evicted, after_state):
            kept = _complement(ev, self.old_len)                                # [L, H, new_len]
            ref_pos = p0.gather(2, kept)
            o = ref_pos.argsort(dim=2)
            ref_pos, ref_slot = ref_pos.gather(2, o), kept.gather(2, o)
            got_pos, got_slot = p1[:, :, :new_len].sort(dim=2)
            if got_pos.shape != ref_pos.shape or not torch.equal(got_pos, ref_pos):
                return False
            ref_slots.append(ref_slot)
            got_slots.append(got_slot)
        scratch = torch.empty_like(self.caches[0]) if self.clones is None else None
        for li in range(self.s.layers):
            ref_rows = self.rows.view(self.paged.flat(self.pristine(li, scratch)))
            for i in range(self.n):
                rk, rv = gather_rows(self.rows, ref_rows, self.blocks[i], ref_slots[i][li])
                gk, gv = gather_rows(self.rows, self.row_views[li], self.blocks[i], got_slots[i][li])
                ok |= (_bits(rk) != _bits(gk)).any() | (_bits(rv) != _bits(gv)).any()
        return not bool(ok)


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _complement(ev: Tensor, n: int) -> Tensor:
    """[L, H, n - e] ascending slots not in ev [L, H, e]."""
    L, H, e = ev.shape
    mask = torch.ones(L, H, n, dtype=torch.bool, device=ev.device)
    mask.scatter_(2, ev, False)
    return mask.nonzero()[:, 2].view(L, H, n - e)


# -- the benchmark --------------------------------------------------------------------------------------

def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def measure_cell(cell: Cell, policies: list[str], repeats: int) -> dict:
    dev = cell.device
    out: dict = {}
    # floor
    cell.restore()
    pos = cell.rearm()
    before = [p.clone() for p in pos]
    keep, evicted = cell.floor_keep(pos)
    _timed(lambda: cell.floor_step(keep, pos), dev)
    floor_exact = cell.check(before, evicted, cell.state)
    times = []
    for _ in range(repeats):
        pos = cell.rearm()
        keep, _ev = cell.floor_keep(pos)
        times.append(_timed(lambda: cell.floor_step(keep, pos), dev)[0])
    floor = statistics.median(times)
    out["floor_ms_per_step"] = round(floor, 4)
    out["floor_exact"] = floor_exact
    out["policies"] = {}
    for name in policies:
        policy = make_policy(name)
        cell.restore()
        pos = cell.rearm()
        before = [p.clone() for p in pos]
        _ms, evicted = _timed(lambda: cell.step(name, policy, pos), dev)     # warm-up, checked
        exact = cell.check(before, evicted, cell.state)
        times = []
        for _ in range(repeats):
            pos = cell.rearm()
            times.append(_timed(lambda: cell.step(name, policy, pos), dev)[0])
        ms = statistics.median(times)
        out["policies"][name] = {"ms_per_step": round(ms, 4), "ms_per_request": round(ms / cell.n, 4),
                                 "ratio_to_floor": round(ms / floor, 4) if floor > 0 else None, "exact": exact}
    return out


def cell_memory(requests: int, budget: int, s: CompactionShapes, dtype: torch.dtype, chunk: int, pristine: str,
                device: str = "cpu") -> dict:
    """Estimated peak bytes of a cell: the cache, its pristine copy (a clone, or one regenerated layer),
    apply_rounds' row indices (int64 per row: 2d/chunk rows per entry; per round and concatenated) and
    the floor's (in groups of at most FLOOR_INDEX_BYTES)."""
    cache = cache_bytes(requests, budget, s, dtype)
    runs = 2 * s.head_dim // chunk
    rounds = requests * s.layers * s.kv_heads * s.buffer * runs * 8 * 2 * 2
    per_req = s.layers * s.kv_heads * (budget + s.buffer) * runs * 8 * 2
    floor = 2 * min(requests * per_req, max(per_req, FLOOR_INDEX_BYTES[device]))
    pristine_b = cache if pristine == "clone" else cache // s.layers
    return {"cache": cache, "total": cache + pristine_b + max(rounds, floor)}


def run_compaction_bench(*, device: str = "cpu", requests: list[int] | None = None, budgets: list[int] | None = None,
                         shapes: CompactionShapes = CompactionShapes(), layouts: list[str] | None = None,
                         policies: list[str] | None = None, repeats: int | None = None, dtype: str = "bfloat16",
                         threads: int | None = 1, max_gb: float | None = None, seed: int = 0,
                         cpu_writer: str = "auto", pristine: str | None = None,
                         progress: Callable[[dict], None] | None = None) -> dict:
    """The JSON report. max_gb: skip cells whose estimated peak memory (cell_memory) is larger (default:
    cpu 10 GiB, i.e. caches up to ~4 GiB; cuda 75% of free device memory). progress(report) is called
    after each cell with the report so far."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    requests = requests or ([1, 64, 256] if dev.type == "cuda" else [1, 8])
    budgets = budgets or [1024, 2048]
    layouts = layouts or ["flash", "cpu"]
    policies = policies or ["random", "snapkv", "rkv"]
    repeats = repeats or (10 if dev.type == "cuda" else 3)
    pristine = pristine or ("regenerate" if dev.type == "cuda" else "clone")
    if max_gb is None:
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            max_gb = 0.75 * free / 2**30
        else:
            max_gb = 10.0
    report: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "shapes": {**asdict(shapes), "dtype": dtype, "repeats": repeats, "max_gb": round(max_gb, 2), "pristine": pristine},
        "layouts": {}, "cells": [], "targets": dict(TARGETS), "skipped": [],
    }
    for name in layouts:
        lw = layout_writer(name, shapes, dev, dt, cpu_writer=cpu_writer)
        nb = _pool_size(3, name, shapes)
        _paged, rows = lw.probe(torch.empty(cache_shape(name, nb, shapes), dtype=dt, device=dev), nb, shapes)
        report["layouts"][name] = {"chunk": rows.chunk, "writer": lw.writer, **lw.info}
        for budget in budgets:
            for n in requests:
                mem = cell_memory(n, budget, shapes, dt, rows.chunk, pristine, dev.type)
                if mem["total"] > max_gb * 2**30:
                    report["skipped"].append({"layout": name, "budget": budget, "requests": n,
                                              "reason": f"estimated {mem['total'] / 2**30:.1f} GiB (cache "
                                                        f"{mem['cache'] / 2**30:.1f} GiB) > cap {max_gb:.1f} GiB"})
                    continue
                cell = Cell(lw, budget, n, shapes, device=dev, dtype=dt, seed=seed, pristine=pristine)
                res = measure_cell(cell, policies, repeats)
                report["cells"].append({"layout": name, "budget": budget, "requests": n,
                                        "cache_gib": round(mem["cache"] / 2**30, 4), **res})
                del cell
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if progress is not None:
                    report["summary"] = _summary(report, dev)
                    progress(report)
    report["summary"] = _summary(report, dev)
    return report


def _summary(report: dict, dev: torch.device) -> dict:
    """Exactness over every cell; random's worst ratio to the floor; random's ms per request at K=2048
    per layout and request count (the H200 target is judged at the largest request count run)."""
    cells = report["cells"]
    out: dict = {"all_exact": all(c["floor_exact"] and all(p["exact"] for p in c["policies"].values()) for c in cells)}
    rnd = [c for c in cells if "random" in c["policies"]]
    if rnd:
        out["random_ratio_to_floor_max"] = max(c["policies"]["random"]["ratio_to_floor"] for c in rnd)
        out["random_ratio_target_met"] = out["random_ratio_to_floor_max"] <= TARGETS["random_ratio_to_floor_max"]
        at2048: dict = {}
        for c in rnd:
            if c["budget"] == 2048:
                at2048.setdefault(c["layout"], {})[str(c["requests"])] = c["policies"]["random"]["ms_per_request"]
        if at2048:
            out["random_ms_per_request_at_2048"] = at2048
            if dev.type == "cuda":
                top = max(c["requests"] for c in rnd)
                worst = max(c["policies"]["random"]["ms_per_request"] for c in rnd
                            if c["budget"] == 2048 and c["requests"] == top)
                out["h200_ms_per_request_target_met"] = worst <= TARGETS["h200_ms_per_request_at_2048_max"]
    return out
