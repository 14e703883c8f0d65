"""R-KV: SnapKV importance mixed with a key-redundancy term (Cai et al., 2025)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import EvictionContext, PolicyError, unit_rows
from .registry import register
from .snapkv import SnapKVPolicy


def mean_key_cosine(keys: Tensor) -> Tensor:
    """[H, S]: c̄_i = 1/(S-1) Σ_{j≠i} cos(k_i, k_j), in O(S·d) via Σ_j k̂_j (0 when S = 1)."""
    u = unit_rows(keys)
    S = u.shape[1]
    total = (u * u.sum(dim=1, keepdim=True)).sum(dim=-1)  # k̂_i · Σ_j k̂_j, includes j = i
    return (total - (u * u).sum(dim=-1)) / max(S - 1, 1)


@register
class RKVPolicy(SnapKVPolicy):
    """s_i = λ · ŝ_i + (1 − λ) · (1 − c̄_i)   (paper §2; λ = `mix_lambda`).

    ŝ_i is the SnapKV score (window attention, max-pooled; `window`/`kernel` as in `snapkv`) divided by
    its per-head mean over the candidates, so ŝ has mean 1 whatever the window length or softmax
    denominator. c̄_i is the mean cosine similarity of k_i to the other candidates' (post-RoPE) keys.

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

    def __init__(self, *, mix_lambda: float = 0.5, **kw) -> None:
        super().__init__(**kw)
        if not 0.0 <= mix_lambda <= 1.0:
            raise PolicyError(f"mix_lambda must be in [0, 1], got {mix_lambda}")
        self.mix_lambda = float(mix_lambda)

    def params(self) -> dict:
        return {**super().params(), "mix_lambda": self.mix_lambda}

    def importance(self, ctx: EvictionContext) -> Tensor:
        """ŝ: the SnapKV score scaled to mean 1 per head."""
        snap = super().score(ctx)
        return snap / snap.mean(dim=1, keepdim=True).clamp_min(torch.finfo(snap.dtype).tiny)

    def score(self, ctx: EvictionContext) -> Tensor:
        lam = self.mix_lambda
        return lam * self.importance(ctx) + (1.0 - lam) * (1.0 - mean_key_cosine(ctx.keys))
