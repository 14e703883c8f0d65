"""VaSE: keep the widest-valued positions, sample the rest in proportion to SnapKV (Chang et al., 2026)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import KEYS, QUERIES, VALUES, EvictionContext, PolicyError, SelectionPolicy
from .registry import register
from .scoring import top_per_row
from .snapkv import SnapKVPolicy


def sample_per_row(weights: Tensor, counts: Tensor, eligible: Tensor, generator: torch.Generator | None) -> Tensor:
    """[H, S] bool: per row h, counts[h] eligible entries drawn without replacement, each draw with
    probability proportional to `weights` among the entries not yet drawn (successive sampling, as
    torch.multinomial(replacement=False)). Done as Gumbel-top-k: the counts[h] largest log w + G, with
    G i.i.d. standard Gumbel, have exactly that distribution; it allows a different count per row."""
    w = weights.float().clamp_min(torch.finfo(torch.float32).tiny)  # every eligible entry stays drawable
    u = torch.rand(w.shape, generator=generator, device=w.device).clamp_min(torch.finfo(torch.float32).tiny)
    return top_per_row(w.log() - (-u.log()).log(), counts, eligible)


@register
@dataclass(kw_only=True, eq=False, repr=False)
class VaSEPolicy(SelectionPolicy, SnapKVPolicy):
    """Per KV head: protected candidates first (they count toward K); then the n_large unprotected ones
    with the largest value range max_j v_ij − min_j v_ij; the remaining K − protected − n_large are drawn
    without replacement from the rest with probability ∝ their SnapKV score (seeded `ctx.generator`).

    n_large = floor(K · large_fraction) (paper App. F: K/4) unless `n_large` is given; it must be < K and
    is cut to the room left by the protected ones. `score()` is the SnapKV fill weight (window/kernel as
    in `snapkv`); the keep-set itself is built by `keep_mask`.
    """

    name = "vase"
    needs = frozenset({KEYS, VALUES, QUERIES})

    large_fraction: float = 0.25
    n_large: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.large_fraction < 1.0:
            raise PolicyError(f"large_fraction must be in [0, 1), got {self.large_fraction}")
        if self.n_large is not None and self.n_large < 0:
            raise PolicyError(f"n_large must be >= 0, got {self.n_large}")
        self.large_fraction = float(self.large_fraction)
        self.n_large = None if self.n_large is None else int(self.n_large)

    def large_count(self, budget: int) -> int:
        n = int(budget * self.large_fraction) if self.n_large is None else self.n_large
        if n >= budget:
            raise PolicyError(f"n_large={n} must be < budget={budget}")
        return n

    def check_budget(self, budget: int, prompt_len: int) -> None:
        super().check_budget(budget, prompt_len)
        self.large_count(budget)

    def keep_mask(self, ctx: EvictionContext) -> Tensor:
        protected = self.protected_mask(ctx)
        room = ctx.budget - protected.sum(dim=1)
        n_large = room.clamp(max=self.large_count(ctx.budget))
        values = ctx.values.float()
        large = top_per_row(values.amax(dim=-1) - values.amin(dim=-1), n_large, ~protected)
        taken = protected | large
        return taken | sample_per_row(self.score(ctx), room - n_large, ~taken, ctx.generator)
