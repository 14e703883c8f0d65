"""kvtier's patches on vLLM's KV cache manager (vllm.v1.core.kv_cache_manager `KVCacheManager` and
kv_cache_coordinator `KVCacheCoordinator`, in the engine-core process): block allocation and the prefix
cache. Listed with why in patches.py `PATCHES`.

Each function takes vLLM's original and returns its replacement, which calls the original; the manager and
coordinator carry the scheduler's eviction state as `_kvtier` (compat.attach_to_kv_cache_manager; None
without additional_config.kvtier). Assumes, of vLLM 0.31: `allocate_slots(request, num_new_tokens, ...)`
reads request.num_computed_tokens and the scheduler passes new_computed_blocks by keyword;
`get_computed_blocks(request)` returns (KVCacheBlocks, num_tokens, boundary) with block-aligned hits (one
full-attention group); every caller of block hashing goes through the coordinator's
`cache_blocks(request, num_computed_tokens)`, which one-group models (UnitaryKVCacheCoordinator) inherit.
"""

from __future__ import annotations

import functools


# -- allocation (sizing and reserve-mode admission) ---------------------------------------------------
def allocate_slots(orig):
    @functools.wraps(orig)
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        st = ev.states.get(request.request_id) if ev is not None else None
        if st is None:
            return orig(self, request, num_new_tokens, *args, **kwargs)
        from . import compat
        from .scheduler_side import is_waiting

        waiting = is_waiting(request)
        shared = compat.held_hit_blocks(kwargs.get("new_computed_blocks")) if waiting else 0
        if waiting and not ev.admit(request, shared):
            return None
        offset = st.offset
        # vLLM sizes the request from num_computed_tokens (logical); the cache holds the physical length.
        request.num_computed_tokens -= offset
        try:
            blocks = orig(self, request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += offset
        if blocks is not None and waiting:
            ev.admitted(request, shared)
        return blocks
    return allocate_slots


# -- prefix cache (scheduler_side.prefix_cache_caps) --------------------------------------------------
def get_computed_blocks(orig):
    @functools.wraps(orig)
    def get_computed_blocks(self, request, *args, **kwargs):
        blocks, num_tokens, *rest = orig(self, request, *args, **kwargs)
        ev = getattr(self, "_kvtier", None)
        if ev is not None and num_tokens:
            allowed = ev.readable_tokens(request.request_id, num_tokens)
            if allowed < num_tokens:
                from . import compat

                blocks, num_tokens = compat.truncate_hit(self, blocks, allowed), allowed
        return (blocks, num_tokens, *rest)
    return get_computed_blocks


def cache_blocks(orig):
    @functools.wraps(orig)
    def cache_blocks(self, request, num_computed_tokens, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            num_computed_tokens = ev.cacheable_tokens(request.request_id, num_computed_tokens)
        return orig(self, request, num_computed_tokens, *args, **kwargs)
    return cache_blocks
