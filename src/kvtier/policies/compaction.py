"""Per-KV-head compaction of one request's cache, and its slot -> logical-position map.

Decode attention over post-RoPE keys does not depend on slot order, so a round need not move the
survivors: `hole_fill_plan` moves only the surviving entries of the tail [L', L) into the evicted slots
below L' (at most r entries per head). `full_gather_plan` is the reference (and the paper's engine):
gather every survivor in chronological order. Both are expressed as per-head (src, dst) slot pairs so
dense tensors here and vLLM's paged cache in `kvtier.engine` apply the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .base import EvictionContext, EvictionPolicy, PolicyError
from .schedule import EvictionSchedule


@dataclass
class CompactionPlan:
    """Copy slot src[h, j] to slot dst[h, j] for every head h, then the cache has `new_len` entries."""

    src: Tensor  # [H, m] long
    dst: Tensor  # [H, m] long
    new_len: int


def hole_fill_plan(evicted_slots: Tensor, cached_len: int) -> CompactionPlan:
    """evicted_slots: [H, e] ascending slot indices. Survivors in the tail [L-e, L) fill the holes below L-e.

    Every head gets e pairs: the first m_h fill holes; the rest copy a dead tail slot onto another dead
    tail slot (both >= new_len), harmless, which keeps shapes rectangular.
    """
    H, e = evicted_slots.shape
    new_len = cached_len - e
    if e == 0:
        empty = evicted_slots.new_empty(H, 0)
        return CompactionPlan(empty, empty, cached_len)
    dead_tail = torch.zeros(H, e, dtype=torch.bool, device=evicted_slots.device)
    in_tail = evicted_slots >= new_len
    dead_tail.scatter_(1, (evicted_slots - new_len).clamp(min=0), in_tail)
    # Tail slots ordered survivors first (ascending), then the dead ones.
    order = (dead_tail.long() * e + torch.arange(e, device=evicted_slots.device)).argsort(dim=1)
    return CompactionPlan(src=order + new_len, dst=evicted_slots, new_len=new_len)


def full_gather_plan(keep_slots: Tensor, cached_len: int) -> CompactionPlan:
    """keep_slots: [H, n] slots to keep, in the order they should end up (slots 0..n-1)."""
    H, n = keep_slots.shape
    return CompactionPlan(src=keep_slots, dst=torch.arange(n, device=keep_slots.device).expand(H, n), new_len=n)


def apply_plan_dense(cache: Tensor, plan: CompactionPlan) -> None:
    """Apply a plan in place to a dense [H, capacity, ...] tensor (K or V of one layer, or many stacked)."""
    if plan.src.numel() == 0:
        return
    H = cache.shape[0]
    base = (torch.arange(H, device=cache.device) * cache.shape[1]).unsqueeze(1)
    copy_rows(cache.view(H * cache.shape[1], -1), (plan.dst + base).reshape(-1), (plan.src + base).reshape(-1))


def copy_rows(rows: Tensor, dst: Tensor, src: Tensor) -> None:
    """rows[dst] = rows[src] for the rows of a 2-D tensor; every source is read before any write (a full
    gather's sources and destinations overlap). Destinations must be distinct."""
    if rows.device.type == "cpu" and rows.is_contiguous() and dst.device.type == "cpu":
        # numpy moves a row as one fixed-size element (a memcpy per row); torch's CPU index_copy_ goes
        # element by element, several times slower for 256-byte K/V rows
        nbytes = rows.shape[1] * rows.element_size()
        as_void = rows.view(torch.uint8).numpy().view(np.dtype((np.void, nbytes))).reshape(-1)
        np.put(as_void, dst.numpy(), np.take(as_void, src.numpy()))
        return
    wide = _wide_rows(rows)
    wide.index_copy_(0, dst, wide.index_select(0, src))


def _wide_rows(rows: Tensor) -> Tensor:
    """The same bytes with the widest element type that tiles a row: CPU index_copy_ works per element,
    so fewer, wider elements move a row faster (a 128 x bf16 row becomes 16 x complex128)."""
    nbytes = rows.shape[1] * rows.element_size()
    for dt in (torch.complex128, torch.int64, torch.int32):
        size = torch.empty((), dtype=dt).element_size()
        if nbytes % size == 0 and rows.element_size() <= size and rows.is_contiguous():
            try:
                return rows.view(dt)
            except RuntimeError:
                continue
    return rows


class DenseHeadCache:
    """One request's K/V for one layer, per KV head, with hole-filling eviction rounds.

    Used by the reference engine and the tests; the paged vLLM cache applies the same plans.
    """

    def __init__(self, num_heads: int, head_dim: int, capacity: int, *, dtype=torch.float32, device="cpu"):
        self.keys = torch.zeros(num_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.full((num_heads, capacity), -1, dtype=torch.long, device=device)
        self.length = 0

    def append(self, k: Tensor, v: Tensor, position: int | Tensor) -> None:
        """k, v: [H, n, d] for n new tokens at consecutive logical positions starting at `position`."""
        n = k.shape[1]
        if self.length + n > self.keys.shape[1]:
            raise PolicyError(f"cache capacity {self.keys.shape[1]} exceeded (length {self.length} + {n})")
        sl = slice(self.length, self.length + n)
        self.keys[:, sl], self.values[:, sl] = k, v
        self.positions[:, sl] = torch.arange(int(position), int(position) + n, device=self.positions.device)
        self.length += n

    def context(self, policy: EvictionPolicy, schedule: EvictionSchedule, prompt_len: int, **extra) -> tuple[EvictionContext, Tensor | None]:
        """The candidates' context, chronological unless the policy is order-free; returns (ctx, order)
        where order[h, j] is the slot of candidate j (None when candidates are in slot order)."""
        n_cand = schedule.num_candidates(self.length)
        pos = self.positions[:, :n_cand]
        order = None if policy.order_free else pos.argsort(dim=1)
        def view(t: Tensor) -> Tensor:
            t = t[:, :n_cand]
            return t if order is None else t.gather(1, order.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
        ctx = EvictionContext(
            positions=pos if order is None else pos.gather(1, order),
            budget=schedule.budget,
            prompt_len=prompt_len,
            keys=view(self.keys) if "keys" in policy.needs else None,
            values=view(self.values) if "values" in policy.needs else None,
            buffer_keys=self.keys[:, n_cand : self.length] if "buffer_keys" in policy.needs or "buffer_keys" in getattr(policy, "optional", ()) else None,
            **extra,
        )
        return ctx, order

    def evict_round(self, policy: EvictionPolicy, schedule: EvictionSchedule, prompt_len: int, *, gather: bool = False, **extra) -> None:
        """Run one round now (hole filling by default, the full gather as the reference)."""
        ctx, order = self.context(policy, schedule, prompt_len, **extra)
        if gather:
            keep = policy.keep(ctx)
            keep_slots = keep if order is None else order.gather(1, keep)
            buffer = torch.arange(ctx.num_candidates, self.length, device=keep.device).expand(keep.shape[0], -1)
            plan = full_gather_plan(torch.cat([keep_slots, buffer], dim=1), self.length)
        else:
            evict = policy.evict(ctx)
            evict_slots = evict if order is None else order.gather(1, evict).sort(dim=1).values
            plan = hole_fill_plan(evict_slots, self.length)
        for t in (self.keys, self.values):
            apply_plan_dense(t, plan)
        apply_plan_dense(self.positions.unsqueeze(-1), plan)
        self.positions[:, plan.new_len :] = -1
        self.length = plan.new_len

    def kept_positions(self, buffer: int) -> Tensor:
        """[H, n] logical positions held outside the recent buffer, ascending."""
        held = self.positions[:, : self.length].sort(dim=1).values
        return held[:, : max(self.length - buffer, 0)]

    def attend(self, q: Tensor) -> Tensor:
        """Decode attention: q [H_q, d] against the cached entries; returns [H_q, d]."""
        H, d = self.keys.shape[0], self.keys.shape[2]
        group = q.shape[0] // H
        dt = torch.promote_types(self.keys.dtype, torch.float32)  # bf16 caches attend in fp32
        k, v = self.keys[:, : self.length].to(dt), self.values[:, : self.length].to(dt)
        qg = q.to(dt).view(H, group, d)
        w = torch.softmax(qg @ k.transpose(1, 2) / d**0.5, dim=-1)
        return (w @ v).view(H * group, d)
