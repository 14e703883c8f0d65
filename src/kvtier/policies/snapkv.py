"""SnapKV: attention from a window of recent queries, max-pooled over neighbouring positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from .base import BUFFER_KEYS, KEYS, QUERIES, EvictionContext, EvictionPolicy, PolicyError
from .registry import register
from .scoring import grouped_window_attention


@register
@dataclass(kw_only=True, eq=False, repr=False)
class SnapKVPolicy(EvictionPolicy):
    """s_i = maxpool_k( mean_{g in group} Σ_{t in window} α_{g,i}^(t) ): the window's attention averaged
    over each KV head's query group first, then max-pooled over k neighbouring candidates.

    Two choices differ from kvpress's SnapKVPress and are pinned by tests/test_policies_scored.py:
    * **max-pooling**, as SnapKV's released code and R-KV (`rkv/compression/snapkv.py`) do; kvpress
      average-pools (`F.avg_pool1d`). A max keeps a single sharp peak's neighbours as high as the peak.
    * **group mean, then pool** (G > 1 query heads per KV head): kvpress pools each query head's scores,
      then averages over the group. With max-pooling the orders differ (two heads peaking at different
      positions: the mean of their pooled maxima is not the pool of their mean).

    `window` is how many recent queries the engine keeps (it provides `queries` [H_q, w, d]);
    softmax runs over candidates plus the recent buffer's keys when the engine provides them.
    α^(t) is causal, as in the model and in SnapKV / kvpress (which mask the window's upper triangle):
    window query t sees no buffer key newer than itself (`scoring.window_attention`), so the newest
    query's softmax runs over every key and the oldest one's over the candidates plus the buffer keys up
    to its own. Candidates newer than a window query (only when the window exceeds the buffer) are hidden
    by position when the context has `query_position`.
    """

    name = "snapkv"
    needs = frozenset({KEYS, QUERIES})
    optional = frozenset({BUFFER_KEYS})
    default_protect_prompt = False
    default_sinks = 4

    window: int = 8
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window <= 0:
            raise PolicyError(f"window must be > 0, got {self.window}")
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise PolicyError(f"kernel must be a positive odd number, got {self.kernel}")
        self.window, self.kernel = int(self.window), int(self.kernel)

    def score(self, ctx: EvictionContext) -> Tensor:
        attn = grouped_window_attention(ctx.keys, ctx.queries[:, -self.window :], ctx.buffer_keys,
                                        positions=ctx.positions, query_position=ctx.query_position)
        if self.kernel == 1:
            return attn
        return F.max_pool1d(attn.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2).squeeze(1)
