"""Structural policies without a score: recency (+prompt) and StreamingLLM (sinks + recent)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import EvictionContext, EvictionPolicy
from .registry import register


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RecencyPolicy(EvictionPolicy):
    """Keep the prompt and fill the budget with the most recent candidates (paper §5.1)."""

    name = "recency"
    default_protect_prompt = True

    def score(self, ctx: EvictionContext) -> Tensor:
        return ctx.positions.float()


@register
@dataclass(kw_only=True, eq=False, repr=False)
class StreamingPolicy(RecencyPolicy):
    """StreamingLLM: attention sinks plus the most recent candidates."""

    name = "streaming"
    default_protect_prompt = False
    default_sinks = 4
