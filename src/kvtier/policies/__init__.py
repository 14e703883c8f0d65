"""Decode-time KV eviction policies (torch only; no vLLM import).

    from kvtier.policies import make_policy, EvictionContext
    keep = make_policy("random").keep(ctx)   # [H_kv, K] per-head keep-set, chronological
"""

from .base import EvictionContext, EvictionPolicy, PolicyError
from .compaction import CompactionPlan, DenseHeadCache, apply_plan_dense, full_gather_plan, hole_fill_plan
from .registry import available, make_policy, policy_class, register
from .schedule import EvictionSchedule
from .scoring import complement

# Importing the modules registers their policies.
from . import diverse as _diverse, h2o as _h2o, random as _random, random_reserve as _random_reserve, random_line_reserve as _random_line_reserve, rkv as _rkv, snapkv as _snapkv, triattention as _triattention, vase as _vase, window as _window  # noqa: E402,F401,E501

__all__ = [
    "EvictionContext", "EvictionPolicy", "PolicyError", "complement", "CompactionPlan", "DenseHeadCache",
    "apply_plan_dense", "full_gather_plan", "hole_fill_plan", "available", "make_policy", "policy_class",
    "register", "EvictionSchedule",
]
