"""R-KV: SnapKV importance mixed with a key-redundancy term (Cai et al., 2025)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import EvictionContext, PolicyError
from .registry import register
from .scoring import unit_rows
from .snapkv import SnapKVPolicy


def mean_key_cosine(keys: Tensor, others: Tensor | None = None) -> Tensor:
    """[H, S]: c̄_i = 1/(N-1) Σ_{j≠i} cos(k_i, k_j) over the N = S + r keys of `keys` [H, S, d] and
    `others` [H, r, d] (r = 0 when None), in O(N·d) via Σ_j k̂_j (0 when N = 1)."""
    u = unit_rows(keys)
    S = u.shape[1]
    pool = u.sum(dim=1, keepdim=True)
    n = S
    if others is not None:
        pool = pool + unit_rows(others).sum(dim=1, keepdim=True)
        n += others.shape[1]
    total = (u * pool).sum(dim=-1)  # k̂_i · Σ_j k̂_j, includes j = i
    return (total - (u * u).sum(dim=-1)) / max(n - 1, 1)


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RKVPolicy(SnapKVPolicy):
    """s_i = λ · ŝ_i + (1 − λ) · (1 − c̄_i)   (paper §2; λ = `mix_lambda`).

    ŝ_i is the SnapKV score (window attention, causal and max-pooled; `window`/`kernel` as in `snapkv`)
    divided by its per-head mean over the candidates, so ŝ has mean 1. Its softmax runs over the
    candidates **and** the recent buffer's keys (as `snapkv`); R-KV's covers the candidates only. For a
    window of one query the two rank candidates identically (the extra keys only rescale the one softmax,
    and the mean-1 scaling removes the scale); for w > 1 they do not: each window query's vote is weighted
    by the share of its mass that falls on the candidates rather than the buffer, a share R-KV's softmax
    fixes at 1 (on the reasoner's real keys no keep-set of 16 was identical). Pinned by
    tests/test_policies_scored.py. c̄_i is the mean cosine similarity of k_i to the other cached (post-RoPE) keys:
    the other candidates and the recent buffer's keys (the window's own keys among them) when the engine
    provides them (`buffer_keys`, which both engines do), N − 1 = S + r − 1 of them, as in the paper's
    c̄_i = 1/(N−1) Σ_{j≠i} cos(k_i, k_j) over the cached keys and in R-KV's `cal_similarity`, which runs
    over every cached key, observation window included; over the other candidates only (N = S) when the
    context has no buffer keys.

    Why unit mean: R-KV's released scorer (Zefan-Cai/R-KV, `rkv/compression/r1_kv.py` with
    `rkv/utils.py::cal_similarity`) mixes λ·a_i − (1−λ)·softmax_i(c̄), where a is the window-mean
    attention (a distribution over the candidates, Σ a = 1 before pooling) and softmax_i(c̄) ≈
    (1 + c̄_i − mean c̄)/S. Multiplying by S, that ranking is, to first order in c̄,
    λ·(S·a_i) + (1−λ)·(1 − c̄_i) + const, i.e. this formula with the attention scaled to mean 1,
    so λ keeps its meaning. Differences kept on purpose: we normalise after pooling (R-KV pools an
    already-normalised distribution), use the linear 1 − c̄ instead of the softmax, average the
    attention over the query group (R-KV max-pools the logits over it), and drop R-KV's exemption of
    each key's most recent near-duplicate (similarity > 0.5), following the paper's formula.

    λ = 0.5 is the paper's setting (Appendix F); R-KV's README recommends λ = 0.1.
    """

    name = "rkv"

    mix_lambda: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise PolicyError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")
        self.mix_lambda = float(self.mix_lambda)

    def importance(self, ctx: EvictionContext) -> Tensor:
        """ŝ: the SnapKV score scaled to mean 1 per head."""
        snap = super().score(ctx)
        return snap / snap.mean(dim=1, keepdim=True).clamp_min(torch.finfo(snap.dtype).tiny)

    def score(self, ctx: EvictionContext) -> Tensor:
        lam = self.mix_lambda
        return lam * self.importance(ctx) + (1.0 - lam) * (1.0 - mean_key_cosine(ctx.keys, ctx.buffer_keys))
