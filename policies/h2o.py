"""H2O: heavy hitters by the attention a position has accumulated since it entered the cache."""

from __future__ import annotations

from torch import Tensor

from .base import ATTENTION, EvictionContext, EvictionPolicy
from .registry import register


@register
class H2OPolicy(EvictionPolicy):
    """s_i = Σ_{t'=i}^{t} α_i^(t') (Zhang et al., 2023; paper §2).

    The engine keeps the running sum per (layer, KV head, cached position) and hands it over as
    `attention` [H, S]: every decode step adds that step's attention (averaged over the KV head's query
    group) to each cached entry, and the sum moves with its entry when the cache is compacted. Evicted
    entries take their sums with them; a new entry starts from the attention it gets at its own step.
    The recent buffer plays the role of H2O's local window.
    """

    name = "h2o"
    needs = frozenset({ATTENTION})
    default_protect_prompt = False
    default_sinks = 4

    def score(self, ctx: EvictionContext) -> Tensor:
        return ctx.attention
