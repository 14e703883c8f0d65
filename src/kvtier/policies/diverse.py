"""Diversity-aware, layer-wise scoring ("Beyond Mean Attention"): mean attention plus dispersion, then
greedy MMR admission with a key-redundancy term, coefficients set per layer by a depth profile.

Reconstructed from the fragment (its equations are missing; what is ours is marked *):
  base       s_i = μ_i + λ1·σ_i, μ/σ the mean / sample std (ddof 1) of the attention the w window queries
             put on i (each query's attention averaged over the KV head's query group*; σ = 0 if w = 1).
  normalise  s̃_i = s_i / max(max_j s_j, ε) over the unprotected candidates* ("denominator clamped to a
             positive value, preserving the ranking; s̃ ∈ [0, 1] when λ1 ≥ 0" fits max-scaling).
  admit      first i* = argmax s̃, then repeatedly argmax_{i ∉ S} s̃_i + λ2·corr(i, S),
             corr(i, S) = max(0, max_{j ∈ S} cos(k_i, k_j)) on post-RoPE keys, until |S| = B, among the
             top 4B candidates by s. B = K − protected; protected positions are kept but not in S*.
  depth      λ = sinh(a(ℓ)), separately for λ1 and λ2, ℓ = 0..L−1:
             global   a(ℓ) = a                      (params: (a,))
             segments a(ℓ) = a_⌊3ℓ/L⌋               (params: (shallow, middle, deep); thirds by ⌊3ℓ/L⌋*)
             curve    a(ℓ) = c0 + c1·x + c2·x²,  x = 2ℓ/(L−1) − 1 ∈ [−1, 1]*  (params: (c0, c1, c2))
Default: global with λ1 = 0, λ2 = −0.15 (the fragment's fixed rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .base import BUFFER_KEYS, KEYS, QUERIES, EvictionContext, PolicyError, SelectionPolicy
from .registry import register
from .scoring import top_per_row, unit_rows, window_attention

PROFILE_PARAMS = {"global": 1, "segments": 3, "curve": 3}


def depth_lambda(profile: str, params: Sequence[float], layer: int, num_layers: int) -> float:
    """λ^(ℓ) = sinh(a(ℓ)) for one coefficient (module docstring)."""
    if profile not in PROFILE_PARAMS or len(params) != PROFILE_PARAMS[profile]:
        raise PolicyError(f"profile must be one of {sorted(PROFILE_PARAMS)} with {PROFILE_PARAMS.get(profile, '?')} params, got {profile!r} {tuple(params)}")
    if not 0 <= layer < num_layers:
        raise PolicyError(f"layer must be in [0, num_layers={num_layers}), got {layer}")
    if profile == "global":
        a = params[0]
    elif profile == "segments":
        a = params[3 * layer // num_layers]
    else:
        x = 2 * layer / (num_layers - 1) - 1 if num_layers > 1 else 0.0
        a = params[0] + params[1] * x + params[2] * x * x
    return math.sinh(a)


def mmr_admit(score: Tensor, unit_keys: Tensor, pool: Tensor, counts: Tensor, lambda2: float) -> Tensor:
    """[H, S] bool: per head, counts[h] greedy admissions from `pool`, each maximising
    score_i + λ2·max(0, max_{j admitted} cos(k_i, k_j)); unit_keys are L2-normalised."""
    H, S = score.shape
    rows = torch.arange(H, device=score.device)
    admitted = torch.zeros_like(pool)
    corr = torch.zeros_like(score)
    for step in range(int(counts.max()) if H else 0):
        gain = (score + lambda2 * corr).masked_fill(~pool | admitted, float("-inf"))
        pick = gain.argmax(dim=1)
        active = counts > step
        admitted[rows[active], pick[active]] = True
        sim = (unit_keys @ unit_keys[rows, pick].unsqueeze(-1)).squeeze(-1)  # [H, S]
        corr = torch.maximum(corr, sim.clamp_min(0))
    return admitted


@register
@dataclass(kw_only=True, eq=False, repr=False)
class DiversePolicy(SelectionPolicy):
    """Mean attention + λ1·dispersion, normalised per head, then MMR admission with λ2·redundancy.

    `layer` / `num_layers` come from ctx.extras["layer"] / ["num_layers"] or the constructor (not needed
    for the global profile). `a1`, `a2` are the profile parameters of λ1 and λ2 in a-space (λ = sinh a).
    The window attention is causal, as SnapKV's (`scoring.window_attention`).
    """

    name = "diverse"
    needs = frozenset({KEYS, QUERIES})
    optional = frozenset({BUFFER_KEYS})
    default_protect_prompt = False
    default_sinks = 4

    window: int = 8
    profile: str = "global"
    a1: Sequence[float] = (0.0,)
    a2: Sequence[float] = (math.asinh(-0.15),)
    pool_factor: int = 4
    layer: int | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window <= 0:
            raise PolicyError(f"window must be > 0, got {self.window}")
        if self.pool_factor < 1:
            raise PolicyError(f"pool_factor must be >= 1, got {self.pool_factor}")
        self.window, self.pool_factor = int(self.window), int(self.pool_factor)
        self.a1, self.a2 = tuple(float(a) for a in self.a1), tuple(float(a) for a in self.a2)
        for params in (self.a1, self.a2):  # validate the profile now
            depth_lambda(self.profile, params, 0, 1)

    def lambdas(self, ctx: EvictionContext) -> tuple[float, float]:
        layer = self.layer if ctx.extras.get("layer") is None else ctx.extras["layer"]
        num_layers = self.num_layers if ctx.extras.get("num_layers") is None else ctx.extras["num_layers"]
        if self.profile == "global":
            layer, num_layers = 0, 1
        elif layer is None or num_layers is None:
            raise PolicyError(f"profile {self.profile!r} needs `layer` and `num_layers` (ctx.extras or constructor)")
        return tuple(depth_lambda(self.profile, p, int(layer), int(num_layers)) for p in (self.a1, self.a2))

    def base_score(self, ctx: EvictionContext, lambda1: float) -> Tensor:
        """[H, S] s = μ + λ1·σ over the window queries."""
        attn = window_attention(ctx.keys, ctx.queries[:, -self.window :], ctx.buffer_keys, positions=ctx.positions,
                                query_position=ctx.query_position).mean(dim=1)  # [H, w, S]
        sigma = attn.std(dim=1) if attn.shape[1] > 1 else torch.zeros_like(attn[:, 0])
        return attn.mean(dim=1) + lambda1 * sigma

    def keep_mask(self, ctx: EvictionContext) -> Tensor:
        lambda1, lambda2 = self.lambdas(ctx)
        protected = self.protected_mask(ctx)
        s = self.base_score(ctx, lambda1)
        top = s.masked_fill(protected, float("-inf")).amax(dim=1, keepdim=True)
        s_norm = s / top.clamp_min(torch.finfo(s.dtype).tiny)
        room = ctx.budget - protected.sum(dim=1)
        pool = top_per_row(s, self.pool_factor * room, ~protected)
        return protected | mmr_admit(s_norm, unit_rows(ctx.keys), pool, room, lambda2)
