"""Random Attention (paper Algorithm 1) and its two controls."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import EvictionContext, EvictionPolicy, PolicyError
from .registry import register


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RandomPolicy(EvictionPolicy):
    """Keep the prompt; every other candidate gets an i.i.d. uniform score, independently per KV head.

    Equivalent to Algorithm 1's top-K of uniform scores, but it draws the S-K victims directly
    (a small top-k of the smallest scores), which is what hole-filling compaction consumes.
    Order-free: it never looks at neighbours, so candidates may come in slot order.
    """

    name = "random"
    order_free = True
    default_protect_prompt = True

    def score(self, ctx: EvictionContext) -> Tensor:
        return torch.rand(ctx.positions.shape, generator=ctx.generator, device=ctx.positions.device)

    def evict(self, ctx: EvictionContext) -> Tensor:
        self._validate(ctx)
        H, S = ctx.positions.shape
        n_evict = max(S - ctx.budget, 0)
        n_prot = self.protected_len(ctx.prompt_len)
        # Hole-filling caches keep the protected positions in the first slots (they are never holes and
        # never in the moved tail), so victims can be drawn straight from the slot range after them.
        if type(self).score is RandomPolicy.score and _protected_is_prefix(ctx.positions, n_prot):
            return sample_distinct(H, S - n_prot, n_evict, ctx.generator, ctx.positions.device) + n_prot
        protected = self.protected_mask(ctx)
        scores = self.score(ctx)
        scores = scores.float() if scores.dtype != torch.float64 else scores
        scores = scores.masked_fill(protected, float("inf"))  # protected never among the smallest
        return scores.topk(n_evict, dim=1, largest=False).indices.sort(dim=1).values


def _protected_is_prefix(positions: Tensor, n: int) -> bool:
    """True when every row holds the protected positions (< n) exactly in its first n slots. A row's
    positions are distinct (one cache entry per position), so it is enough that its first n slots hold
    values below n: they are then 0..n-1 and no later slot can hold one. One reduction over [rows, n]
    (the whole rows' min and max cost ~8x more at K = 1024 and were a fifth of a random round)."""
    if n > positions.shape[1]:
        return False
    return n == 0 or int(positions[:, :n].max()) < n


def sample_distinct(rows: int, n: int, k: int, generator: torch.Generator | None, device) -> Tensor:
    """[rows, k] ascending: per row, a uniformly random k-subset of range(n).

    For k << n it draws about 1.5k integers per row and keeps the first k distinct ones in draw order
    (the procedure commutes with relabelling [n], so every k-subset is equally likely); a row with too few
    distinct draws, or a large k, falls back to the top-k of n uniform scores.
    """
    if k == 0:
        return torch.empty(rows, 0, dtype=torch.long, device=device)
    if 4 * k <= n:
        m = k + k // 2 + 8
        draws = torch.randint(0, n, (rows, m), generator=generator, device=device)
        j = torch.arange(m, device=device).expand(rows, m)
        first_at = torch.full((rows, n), m, dtype=torch.long, device=device)
        first_at.scatter_reduce_(1, draws, j, reduce="amin")     # first draw index of each value
        first = first_at.gather(1, draws) == j
        rank = first.cumsum(dim=1)
        take = first & (rank <= k)
        if bool((rank[:, -1] >= k).all()):
            # ascending per row without a sort: mark the chosen values, read them back in order
            chosen = torch.zeros(rows * n, dtype=torch.bool, device=device)
            base = torch.arange(rows, device=device).unsqueeze(1) * n
            chosen[(draws + base)[take]] = True
            return chosen.view(rows, n).nonzero()[:, 1].view(rows, k)
    scores = torch.rand(rows, n, generator=generator, device=device)
    return scores.topk(k, dim=1, largest=False).indices.sort(dim=1).values


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RandomSharedPolicy(RandomPolicy):
    """Control without cross-head diversity: one draw per logical position, shared by every head.

    Scores are keyed by position (not by row index), so heads holding the same positions evict the same
    ones even when their slot orders differ.
    """

    name = "random_shared"

    def score(self, ctx: EvictionContext) -> Tensor:
        pos = ctx.positions
        lo, hi = int(pos.min()), int(pos.max())
        table = torch.rand(hi - lo + 1, generator=ctx.generator, device=pos.device)
        return table[pos - lo]


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RandomBlockPolicy(RandomPolicy):
    """Random Attention over contiguous blocks of `block` positions (paper Figure 3c).

    Every block (position // block) gets one uniform score per head; a block straddling the budget
    boundary is cut, its earliest positions kept first.
    """

    name = "random_block"

    block: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block <= 0:
            raise PolicyError(f"block must be > 0, got {self.block}")
        self.block = int(self.block)

    def score(self, ctx: EvictionContext) -> Tensor:
        pos = ctx.positions
        blocks = pos // self.block
        lo = int(blocks.min())
        u = torch.rand(pos.shape[0], int(blocks.max()) - lo + 1, generator=ctx.generator, device=pos.device)
        rank = u.argsort(dim=1).argsort(dim=1)  # per head, the random rank of each block
        # Integer scores: block rank first, then earlier positions inside a block rank higher.
        return rank.gather(1, blocks - lo) * self.block + (self.block - 1 - pos % self.block)


def sample_free(positions: Tensor, taken: Tensor, k: int, n_free_min: int, generator: torch.Generator | None) -> Tensor:
    """[rows, k] ascending: per row, a uniformly random k-subset of the slots whose position is not taken.

    positions [rows, n] logical position of each slot; taken [P] bool, indexed by position (every position
    in `positions` < P); n_free_min: a lower bound (host) on any row's free slots, >= k. The procedure of
    `sample_distinct` with rejection: about (1.5k + 8)·n / n_free_min draws per row, the first k distinct
    free ones in draw order (draws conditioned on being free are uniform on the free slots, so every free
    k-subset is equally likely). Only the drawn slots' positions are looked up, not the whole row's (a
    [rows, n] top-k of masked uniform scores costs ~10x more on a CPU at K = 1024); a row with too few
    distinct free draws, or a large k, falls back to that top-k. Off the CPU it is always the top-k: the
    draw reads a flag and a count on the host, which a GPU step must not wait for."""
    rows, n = positions.shape
    dev = positions.device
    if k == 0:
        return torch.empty(rows, 0, dtype=torch.long, device=dev)
    if 4 * k <= n_free_min and dev.type == "cpu":
        m = -(-(k + k // 2 + 8) * n // n_free_min)
        draws = torch.randint(0, n, (rows, m), generator=generator, device=dev)
        free = ~taken[positions.gather(1, draws)]
        j = torch.arange(m, device=dev).expand(rows, m)
        first_at = torch.full((rows, n), m, dtype=torch.long, device=dev)
        first_at.scatter_reduce_(1, draws, torch.where(free, j, m), reduce="amin")   # first free draw of each slot
        first = first_at.gather(1, draws) == j
        rank = first.cumsum(dim=1)
        if bool((rank[:, -1] >= k).all()):
            chosen = torch.zeros(rows * n, dtype=torch.bool, device=dev)
            base = torch.arange(rows, device=dev).unsqueeze(1) * n
            chosen[(draws + base)[first & (rank <= k)]] = True
            return chosen.view(rows, n).nonzero()[:, 1].view(rows, k)
    u = torch.rand(rows, n, generator=generator, device=dev).masked_fill_(taken[positions], 2.0)
    return u.topk(k, dim=1, largest=False).indices.sort(dim=1).values
