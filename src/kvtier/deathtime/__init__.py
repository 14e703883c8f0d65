"""Attention under a recorded eviction: the one implementation the oracle, training and the RL learner use.

A sample's eviction is recorded as its **death times**: an integer tensor ``deaths [layers, kv_heads, N]``
where ``deaths[l, h, j]`` is the position of the first query that no longer saw entry j in KV head h of
layer l (`NEVER` for an entry that survived to the end). Key j is visible to query i iff
``j <= i < deaths[l, h, j]``. An entry evicted at a round whose last cached position is q dies at q + 1,
the first query after the round. Only decode-time rounds are representable: a cache rebuilt mid-generation
(preemption, recompute) makes entries visible again, which one death per entry cannot say
(`RebuiltCacheError`).

Where records come from (`record.py`, `simulate.py`):

* `deaths_from_rounds`: the engine's keep-set audit log or the reference engine's round records
  ({query_position, kept: [layers][kv_heads][K]});
* `simulate_deaths`: the schedule (`EvictionSchedule`) and a policy that reads nothing (``random``: the
  engine's keyed draw, so the same seed gives the engine's keep-sets, no engine needed).
  A policy that reads only the first layer's keys (``random_line_reserve``) is simulated from them
  (``first_keys=``, `first_layer_keys`: a function of token and position, not of eviction).

How a model runs under them (`attention.py`): `register()` adds ``ATTN_NAME`` to transformers'
``AttentionInterface`` (and its mask interface), so any Hugging Face causal LM loaded with
``attn_implementation=ATTN_NAME`` attends under the deaths passed to its forward::

    deaths = place_in_batch([d0, d1], width=T, offsets=[left_pad0, left_pad1])   # [B, L, H, T]
    out = model(input_ids=ids, attention_mask=mask, kvtier_deaths=deaths)

Without ``kvtier_deaths`` the forward is plain SDPA. On CPU the path is SDPA with a boolean mask
(differentiable; FlexAttention has no CPU backward in torch 2.13); on CUDA it is FlexAttention with a
``mask_mod`` over the death tensor.

Depends on kvtier.policies only (below the engine, the reference, training and the rollout).
"""

from .attention import ATTN_NAME, register
from .record import NEVER, RebuiltCacheError, deaths_from_rounds, place_in_batch, record_bytes, visibility
from .first_layer import first_layer_keys
from .simulate import reads_first_layer_keys, round_positions, simulate_deaths

__all__ = ["ATTN_NAME", "NEVER", "RebuiltCacheError", "deaths_from_rounds", "first_layer_keys", "place_in_batch",
           "reads_first_layer_keys", "record_bytes", "register", "round_positions", "simulate_deaths", "visibility"]
