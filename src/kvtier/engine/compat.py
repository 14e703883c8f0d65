"""Every read or write of vLLM private state kvtier makes, as named helpers, for each supported vLLM minor
(versions.TESTED: 0.31 and 0.32; the installed one is checked at start-up by `plugin.check_vllm_version`).
Where the minors differ, the helper picks by `versions.installed_minor()` from a table keyed by minor
(`_ROW_BLOCKS`). If vLLM renames one of these attributes, this is the one file to change; surface.py counts
what each helper touches. The patches that call these are listed in `patches.py`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .versions import installed_minor

_minor = functools.cache(installed_minor)

# -- scheduler process -------------------------------------------------------------------------------


def pending_outputs(request) -> int:
    """Output tokens scheduled but not yet returned (async scheduling's placeholders; 0 when synchronous)."""
    return int(getattr(request, "num_output_placeholders", 0) or 0)


def is_plain_decode(request) -> bool:
    """The request decodes exactly one token this step: every known token (sampled or still a placeholder
    under async scheduling) except the newest is cached. False for prefill chunks and recompute."""
    return request.num_computed_tokens == request.num_tokens + pending_outputs(request) - 1


def request_blocks(scheduler, req_id: str) -> list:
    """The request's KV blocks (one full-attention group; `support.check_supported` guarantees one)."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return manager.req_to_blocks.get(req_id, [])


def free_tail_blocks(scheduler, req_id: str, keep_blocks: int) -> int:
    """Return the request's blocks past `keep_blocks` to the pool now; the number freed."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    blocks = manager.req_to_blocks[req_id]
    tail = blocks[keep_blocks:]
    if not tail:
        return 0
    del blocks[keep_blocks:]
    if req_id in manager.num_cached_block:
        manager.num_cached_block[req_id] = min(manager.num_cached_block[req_id], keep_blocks)
    scheduler.kv_cache_manager.block_pool.free_blocks(reversed(tail))
    return len(tail)


def truncate_hit(kv_cache_manager, blocks, num_tokens: int):
    """A prefix-cache hit (`KVCacheBlocks`) cut to its first `num_tokens` tokens (block-aligned); vLLM's
    own pure slice, no reference counts touched."""
    return kv_cache_manager.truncate_computed_blocks(blocks, num_tokens)


def held_hit_blocks(blocks) -> int:
    """Blocks of a prefix-cache hit (`KVCacheBlocks`, one group) that some request already holds
    (ref_cnt > 0); the others sit in the free queue and cost a free block when taken."""
    if blocks is None:
        return 0
    return sum(1 for b in blocks.blocks[0] if b.ref_cnt > 0)


def attach_to_kv_cache_manager(scheduler, ev) -> None:
    """Give the KV cache manager and its coordinator (which caches blocks) the scheduler-side state."""
    scheduler.kv_cache_manager._kvtier = ev
    scheduler.kv_cache_manager.coordinator._kvtier = ev


def fail_requests(scheduler, req_ids) -> None:
    """Finish these requests with FINISHED_ERROR (finish_reason "error"; vLLM's server answers 500) inside
    the next `update_from_output`: vLLM 0.31 drains `encoder_cache_mismatch_reqs` into its error path
    there, which frees the blocks and emits the final output to the client."""
    scheduler.encoder_cache_mismatch_reqs.update(r for r in req_ids if r in scheduler.requests)


def in_process_scheduler(llm):
    """The scheduler of an `LLM` whose engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    inner = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if inner is None:
        raise RuntimeError("scheduler is in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return inner.scheduler


def pool_counts(scheduler) -> tuple[int, int]:
    """(free, usable) KV blocks of the scheduler's pool (vLLM keeps one null block out of use)."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1


def step_limits(scheduler_config) -> tuple[int, int]:
    """(tokens one step may schedule, requests that may run at once), from vLLM's public SchedulerConfig as
    the Scheduler derives them (max_num_scheduled_tokens, else max_num_batched_tokens; max_num_seqs)."""
    tokens = getattr(scheduler_config, "max_num_scheduled_tokens", None) or scheduler_config.max_num_batched_tokens
    return int(tokens), int(scheduler_config.max_num_seqs)


def waiting_head(scheduler):
    """The waiting request vLLM would try to admit first (None: nothing waits)."""
    return scheduler.waiting.peek_request() if scheduler.waiting else None


def kv_block_size(scheduler) -> int:
    return scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


# -- worker process ----------------------------------------------------------------------------------


def batch_req_ids(runner, num_reqs: int) -> list[str]:
    return list(runner.input_batch.req_ids[:num_reqs])


def query_start_loc(runner, num_reqs: int) -> np.ndarray:
    """[num_reqs + 1] host copy of this step's query start offsets."""
    return runner.query_start_loc.np[: num_reqs + 1]


def logical_positions(runner, num_tokens: int) -> torch.Tensor:
    """[num_tokens] RoPE positions of this step's tokens (device tensor)."""
    return runner.positions[:num_tokens]


def num_computed_tokens(runner, num_reqs: int) -> np.ndarray:
    """[num_reqs] host copy of each batch row's computed tokens (the logical position of its first token)."""
    return runner.input_batch.num_computed_tokens_cpu[:num_reqs]


def write_kv(layer, key, value, cache, slot_mapping) -> None:
    """Write K/V rows through the attention backend's own cache-update op (the layout probe uses it)."""
    layer.impl.do_kv_cache_update(layer, key, value, cache, slot_mapping)


def request_block_ids(runner, req_id: str) -> list[int] | None:
    """The worker's block id list of a request (first KV cache group), or None if unknown."""
    state = runner.requests.get(req_id)
    return None if state is None else state.block_ids[0]


def to_physical(runner, num_reqs: int, offsets: torch.Tensor, host_offsets: torch.Tensor) -> None:
    """Rewrite this step's slot mapping and sequence lengths to physical positions: physical = logical -
    offset per request (`offsets` on the device, `host_offsets` the same values on the host). RoPE
    positions (`runner.positions`) stay logical."""
    qsl = query_start_loc(runner, num_reqs)
    total = int(qsl[num_reqs])
    counts = torch.from_numpy(np.diff(qsl).astype(np.int64)).to(offsets.device, non_blocking=True)
    physical = logical_positions(runner, total) - offsets.repeat_interleave(counts, output_size=total)
    runner.input_batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical)
    runner.seq_lens[:num_reqs] -= offsets.to(runner.seq_lens.dtype)
    runner.optimistic_seq_lens_cpu[:num_reqs] -= host_offsets.to(runner.optimistic_seq_lens_cpu.dtype)


def truncate_request_blocks(runner, req_id: str, keep_blocks: int) -> None:
    """Cut the worker's block lists and the persistent block-table row of a request to `keep_blocks` (the
    scheduler already returned the tail to the pool; vLLM's rows are append-only)."""
    state = runner.requests.get(req_id)
    if state is not None:
        for ids in state.block_ids:
            del ids[keep_blocks:]
    row = runner.input_batch.req_id_to_index.get(req_id)
    if row is None:
        return
    for bt in runner.input_batch.block_table.block_tables:
        n = keep_blocks * _ROW_BLOCKS[_minor()](bt)
        old = int(bt.num_blocks_per_row[row])
        if old > n:
            bt.block_table.np[row, n:old] = 0
            bt.num_blocks_per_row[row] = n


# Entries of a block-table row per KV-manager block: vLLM 0.31 splits manager blocks into attention-kernel
# blocks in the row (`BlockTable.blocks_per_kv_block`); 0.32 keeps manager blocks in the row and maps kernel
# blocks in each attention group (vllm/v1/worker/utils.py `map_to_kernel_block_table`).
_ROW_BLOCKS = {"0.31": lambda bt: bt.blocks_per_kv_block, "0.32": lambda bt: 1}


def kv_cache_group(runner):
    return runner.kv_cache_config.kv_cache_groups[0]


def attention_layers(runner) -> dict:
    """Layer name -> vLLM Attention module, for the KV cache group's layers in the group's order (vLLM's public
    `get_layers_from_vllm_config`, which plugins and attention backends use)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    names = kv_cache_group(runner).layer_names
    found = get_layers_from_vllm_config(runner.vllm_config, AttentionLayerBase, names)
    return {name: found[name] for name in names}


def attention_backend_name(runner) -> str:
    """The attention backend the KV cache group's layers run (e.g. CPU_ATTN, FLASH_ATTN)."""
    layer = next(iter(attention_layers(runner).values()))
    return layer.attn_backend.get_name()


def kernel_block_sizes(runner) -> list[int]:
    """The attention kernels' block size per KV cache group (vLLM splits manager blocks when it differs)."""
    return list(getattr(runner, "_kernel_block_sizes", None) or ())


def layer_cache(layer) -> torch.Tensor:
    return layer.kv_cache if isinstance(layer.kv_cache, torch.Tensor) else layer.kv_cache[0]


def tp_all_gather_object(obj) -> list:
    """Every tensor-parallel rank's `obj`, over the TP group's CPU (gloo) group; every rank must call it."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    out = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def tensor_parallel(runner) -> tuple[int, int]:
    """(rank, world size) of tensor parallelism in this worker."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):   # no process group (unit tests)
        return 0, 1


# -- Serve engine replica: vLLM's stat loggers (compat_serve.py; re-exported for kvtier.service) ----------
from .compat_serve import (engine_indexes, in_flight_requests, ray_stat_logger_tagged,  # noqa: E402,F401
                           replace_prometheus_logger, stat_logger_manager, stat_loggers)
