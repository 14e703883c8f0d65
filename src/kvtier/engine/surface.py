"""kvtier's private surface on vLLM, measured: the vLLM functions it wraps or relies on, and the private
attributes it reads or writes, per supported minor (versions.TESTED).

Contract:
- `private_functions(minor)`: every vLLM function whose behaviour kvtier depends on: each patch target in
  patches.PATCHES installed on this platform (`Patch.when`), plus `RELIED_ON[minor]` (private functions
  compat.py calls or whose call path the per-layer attention wrapper assumes). `fingerprints(minor)` hashes
  their source (the unpatched original); versions.check compares a patch release against fingerprints.RECORDED.
- `PRIVATE_STATE[minor]`: per kvtier helper (compat.py, or a patch/side module where noted), the private vLLM
  attributes it reads or writes, as "Owner.attr". tests/test_engine_surface.py fails when a compat helper is
  missing from it. `counts(minor)` is what docs/engine.md reports; `MOVED_TO_PUBLIC` lists what issue #62
  moved onto vLLM's public configuration (counted back in for the "before" figure).
- `python -m kvtier.engine.surface [--record]`: print the counts, or the fingerprints for fingerprints.py.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys

_RELIED_ON = (
    "vllm.v1.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
    "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.truncate_computed_blocks",
    "vllm.v1.core.block_pool:BlockPool.free_blocks",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
    "vllm.model_executor.layers.attention.attention:unified_attention_with_output",
)
RELIED_ON = {"0.31": _RELIED_ON, "0.32": _RELIED_ON}

_SCHED = {
    "compat.pending_outputs": ("Request.num_output_placeholders",),
    "compat.is_plain_decode": ("Request.num_computed_tokens", "Request.num_tokens"),
    "compat.request_blocks": ("Scheduler.kv_cache_manager", "KVCacheManager.coordinator",
                              "KVCacheCoordinator.single_type_managers", "SingleTypeKVCacheManager.req_to_blocks"),
    "compat.free_tail_blocks": ("Scheduler.kv_cache_manager", "KVCacheManager.coordinator",
                                "KVCacheCoordinator.single_type_managers", "SingleTypeKVCacheManager.req_to_blocks",
                                "SingleTypeKVCacheManager.num_cached_block", "KVCacheManager.block_pool"),
    "compat.truncate_hit": (),
    "compat.held_hit_blocks": ("KVCacheBlocks.blocks", "KVCacheBlock.ref_cnt"),
    "compat.attach_to_kv_cache_manager": ("Scheduler.kv_cache_manager", "KVCacheManager._kvtier",
                                          "KVCacheManager.coordinator", "KVCacheCoordinator._kvtier"),
    "compat.fail_requests": ("Scheduler.encoder_cache_mismatch_reqs", "Scheduler.requests"),
    "compat.in_process_scheduler": ("LLMEngine.engine_core", "InprocClient.engine_core", "EngineCore.scheduler"),
    "compat.pool_counts": ("Scheduler.kv_cache_manager", "KVCacheManager.block_pool", "BlockPool.num_gpu_blocks"),
    "compat.step_limits": (),   # vLLM's public SchedulerConfig (was Scheduler.max_num_scheduled_tokens/_running_reqs)
    "compat.waiting_head": ("Scheduler.waiting",),
    "compat.kv_block_size": ("Scheduler.kv_cache_config",),
    "scheduler_side (running requests)": ("Scheduler.running",),
    "patch_scheduler (state, add_request)": ("Scheduler._kvtier", "Scheduler.requests"),
}
_WORKER = {
    "compat.batch_req_ids": ("GPUModelRunner.input_batch", "InputBatch.req_ids"),
    "compat.query_start_loc": ("GPUModelRunner.query_start_loc",),
    "compat.logical_positions": ("GPUModelRunner.positions",),
    "compat.num_computed_tokens": ("GPUModelRunner.input_batch", "InputBatch.num_computed_tokens_cpu"),
    "compat.write_kv": ("Attention.impl",),
    "compat.request_block_ids": ("GPUModelRunner.requests", "CachedRequestState.block_ids"),
    "compat.to_physical": ("GPUModelRunner.query_start_loc", "GPUModelRunner.positions", "GPUModelRunner.input_batch",
                           "InputBatch.block_table", "GPUModelRunner.seq_lens", "GPUModelRunner.optimistic_seq_lens_cpu"),
    "compat.truncate_request_blocks": ("GPUModelRunner.requests", "CachedRequestState.block_ids",
                                       "GPUModelRunner.input_batch", "InputBatch.req_id_to_index",
                                       "InputBatch.block_table", "MultiGroupBlockTable.block_tables",
                                       "BlockTable.num_blocks_per_row", "BlockTable.block_table"),
    "compat.kv_cache_group": ("GPUModelRunner.kv_cache_config",),
    "compat.attention_layers": (),   # vLLM's public get_layers_from_vllm_config (runner.vllm_config: patch_worker)
    "compat.attention_backend_name": ("Attention.attn_backend",),
    "compat.kernel_block_sizes": ("GPUModelRunner._kernel_block_sizes",),
    "compat.layer_cache": ("Attention.kv_cache",),
    "compat.tp_all_gather_object": ("GroupCoordinator.cpu_group",),
    "compat.tensor_parallel": (),
    "patch_worker (state, step)": ("GPUModelRunner.kvtier", "GPUModelRunner.vllm_config", "InputBatch.num_reqs",
                                   "AsyncGPUModelRunnerOutput._model_runner_output", "Worker.model_runner",
                                   "Attention.impl", "Attention._kvtier_capture"),
}
_SERVE = {
    "compat.stat_logger_manager": ("AsyncLLM.logger_manager",),
    "compat.in_flight_requests": ("AsyncLLM.output_processor", "OutputProcessor.request_states"),
    "compat.stat_loggers": ("StatLoggerManager.stat_loggers",),
    "compat.replace_prometheus_logger": ("StatLoggerManager.stat_loggers",),
    "compat.engine_indexes": ("StatLoggerManager.engine_indexes",),
    "compat.ray_stat_logger_tagged": ("RayPrometheusMetric._get_tag_keys", "RayPrometheusMetric._tags",
                                      "RayPrometheusMetric._build_tags", "RayPrometheusMetric.metric",
                                      "RayPrometheusStatLogger._gauge_cls", "RayPrometheusStatLogger._counter_cls",
                                      "RayPrometheusStatLogger._histogram_cls",
                                      "RayPrometheusStatLogger._spec_decoding_cls",
                                      "RayPrometheusStatLogger._kv_connector_cls",
                                      "RayPrometheusStatLogger._perf_metrics_cls"),
    "patch_frontend (state)": ("InputProcessor.vllm_config", "OutputProcessor.request_states"),
}
_COMMON = {**_SCHED, **_WORKER, **_SERVE}
# vLLM 0.31 splits KV-manager blocks into kernel blocks in the block-table row (compat._ROW_BLOCKS)
PRIVATE_STATE = {
    "0.31": {**_COMMON, "compat.truncate_request_blocks":
             (*_COMMON["compat.truncate_request_blocks"], "BlockTable.blocks_per_kv_block")},
    "0.32": _COMMON,
}
# What issue #62 moved onto vLLM's public configuration (helper -> the private attributes it no longer reads)
MOVED_TO_PUBLIC = {
    "compat.step_limits": ("Scheduler.max_num_scheduled_tokens", "Scheduler.max_num_running_reqs"),   # SchedulerConfig
    "compat.skip_prefix_cache_reads": ("Request.skip_reading_prefix_cache",),   # SamplingParams, in the frontend
    "compat.attention_layers": ("GPUModelRunner.compilation_config", "CompilationConfig.static_forward_context"),
}


def _patches(all_platforms: bool = False) -> list:
    from .patches import ATTENTION_CAPTURE, PATCHES  # noqa: F401 (ATTENTION_CAPTURE: counted, not resolvable)

    return [p for p in PATCHES if all_platforms or p.when is None or p.when()]


def private_functions(minor: str) -> list[str]:
    """The vLLM functions kvtier wraps (patch targets on this platform) and relies on, as module:qualname."""
    return [p.target for p in _patches()] + list(RELIED_ON[minor])


def _function(target: str):
    from .patches import _resolve

    owner, name = _resolve(target)
    fn = inspect.getattr_static(owner, name)
    fn = getattr(fn, "__kvtier_original__", fn)
    if isinstance(fn, property):
        fn = getattr(fn.fget, "__wrapped__", fn.fget) if getattr(fn.fget, "__kvtier_patched__", False) else fn.fget
    return getattr(fn, "__func__", fn)


def source_hash(target: str) -> str:
    """sha256 (first 16 hex digits) of the function's source as vLLM ships it; 'missing' if it does not resolve."""
    try:
        src = inspect.getsource(_function(target))
    except (ImportError, AttributeError, OSError, TypeError):
        return "missing"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def fingerprints(minor: str) -> dict[str, str]:
    """{function: source hash} of the installed vLLM for every private function kvtier uses on this platform."""
    return {name: source_hash(name) for name in private_functions(minor)}


def attributes(minor: str, before: bool = False) -> set[str]:
    out = {a for attrs in PRIVATE_STATE[minor].values() for a in attrs}
    if before:
        out |= {a for attrs in MOVED_TO_PUBLIC.values() for a in attrs}
    return out


def counts(minor: str) -> dict[str, int]:
    """The private surface for `minor`: functions wrapped (and how many have private names), functions relied
    on without wrapping, private attributes read or written now and before issue #62."""
    targets = [p.target for p in _patches(all_platforms=True)]
    return {"functions_wrapped": len(targets) + 1,   # + the per-layer attention wrapper (patches.ATTENTION_CAPTURE)
            "underscore_functions_wrapped": sum(t.rsplit(".", 1)[1].startswith("_") and not t.endswith("__init__")
                                                for t in targets),
            "functions_relied_on": len(RELIED_ON[minor]),
            "private_attributes": len(attributes(minor)),
            "private_attributes_before_62": len(attributes(minor, before=True))}


def main(argv: list[str] | None = None) -> None:
    from .versions import installed_minor

    argv = sys.argv[1:] if argv is None else argv
    minor = installed_minor()
    if "--record" in argv:
        print(json.dumps({minor: {t: source_hash(t) for t in private_functions(minor)}}, indent=1))
    else:
        print(json.dumps({minor: counts(minor)}, indent=1))


if __name__ == "__main__":
    main()
