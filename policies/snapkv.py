"""SnapKV: attention from a window of recent queries, max-pooled over neighbouring positions."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .base import BUFFER_KEYS, KEYS, QUERIES, EvictionContext, EvictionPolicy, PolicyError, grouped_window_attention
from .registry import register


@register
class SnapKVPolicy(EvictionPolicy):
    """s_i = maxpool_k( Σ_{t in window} α_i^(t) ), averaged over each KV head's query group.

    `window` is how many recent queries the engine keeps (it provides `queries` [H_q, w, d]);
    softmax runs over candidates plus the recent buffer's keys when the engine provides them.
    """

    name = "snapkv"
    needs = frozenset({KEYS, QUERIES})
    optional = frozenset({BUFFER_KEYS})
    default_protect_prompt = False
    default_sinks = 4

    def __init__(self, *, window: int = 8, kernel: int = 7, **kw) -> None:
        super().__init__(**kw)
        if window <= 0:
            raise PolicyError(f"window must be > 0, got {window}")
        if kernel <= 0 or kernel % 2 == 0:
            raise PolicyError(f"kernel must be a positive odd number, got {kernel}")
        self.window, self.kernel = int(window), int(kernel)

    def params(self) -> dict:
        return {**super().params(), "window": self.window, "kernel": self.kernel}

    def score(self, ctx: EvictionContext) -> Tensor:
        attn = grouped_window_attention(ctx.keys, ctx.queries[:, -self.window :], ctx.buffer_keys)
        if self.kernel == 1:
            return attn
        return F.max_pool1d(attn.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2).squeeze(1)

