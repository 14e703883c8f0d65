"""Every field of vLLM 0.31's and 0.32's config dataclasses, classified for kvtier's allowlist (allowlist.py).

CHECKED: the fields a row of allowlist.TESTED reads (or whole optional sub-configs it requires absent).
NEUTRAL: the rest, grouped by why they do not change what the KV cache holds or how attention reads it.
A field in neither fails tests/test_engine_allowlist.py: a new vLLM field is classified before it can
pass silently.
"""

from __future__ import annotations

CHECKED = frozenset("""
    parallel_config.pipeline_parallel_size parallel_config.tensor_parallel_size
    parallel_config.decode_context_parallel_size parallel_config.prefill_context_parallel_size
    parallel_config.data_parallel_size parallel_config.enable_dbo
    cache_config.enable_prefix_caching cache_config.kv_offloading_size cache_config.kv_sharing_fast_prefill
    cache_config.cache_dtype cache_config.block_size cache_config.sliding_window cache_config.is_attention_free
    cache_config.effective_attention_block_size cache_config.hash_block_size cache_config.cache_hit_alignment_tokens
    kv_transfer_config speculative_config lora_config watermark_config diffusion_config
    attention_config.backend attention_config.backend_per_kind attention_config.hisparse_config
    attention_config.use_non_causal aux_output_config.enable_return_routed_experts
    compilation_config.cudagraph_mode compilation_config.splitting_ops model_config.enforce_eager
    model_config.hf_config model_config.hf_text_config model_config.multimodal_config
    model_config.disable_sliding_window model_config.disable_cascade_attn scheduler_config.scheduler_cls
""".split())

_NEUTRAL_GROUPS = {
    "which model and tokenizer, and how they are loaded (the model's attention shape is checked)": """
        model_config.model model_config.model_weights model_config.tokenizer model_config.tokenizer_mode
        model_config.trust_remote_code model_config.revision model_config.code_revision
        model_config.tokenizer_revision model_config.hf_config_path model_config.hf_token
        model_config.config_format model_config.served_model_name model_config.skip_tokenizer_init
        model_config.allowed_local_media_path model_config.allowed_media_domains model_config.renderer_num_workers
        model_config.io_processor_plugin model_config.hf_overrides model_config.model_class_overrides
        model_config.model_impl model_config.is_submodel_config model_config.word_embeddings_untied_by_checkpoint
        model_config.generation_config model_config.override_generation_config model_config.dtype
        model_config.quantization model_config.quantization_config model_config.allow_deprecated_quantization
        model_config.max_model_len model_config.spec_target_max_model_len model_config.seed
        load_config.load_format load_config.download_dir load_config.safetensors_load_strategy
        load_config.safetensors_prefetch_num_threads load_config.safetensors_prefetch_block_size
        load_config.model_loader_extra_config load_config.device load_config.ignore_patterns
        load_config.use_tqdm_on_load load_config.pt_load_map_location quant_config
        offload_config.offload_backend offload_config.uva offload_config.prefetch weight_transfer_config.backend
        engram_config.cpu_offload engram_config.embedding_across_dp engram_config.dp_shared_memory
        engram_config.use_thp""",
    "sampling and outputs (what is done with the logits, not how attention reads the cache)": """
        model_config.return_sampling_mask model_config.max_logprobs model_config.logprobs_mode
        model_config.use_fp64_gumbel model_config.enable_trace_replay model_config.enable_prompt_embeds
        model_config.logits_processors model_config.pooler_config model_config.runner model_config.convert
        scheduler_config.runner_type aux_output_config.max_bytes
        structured_outputs_config.backend structured_outputs_config.disable_any_whitespace
        structured_outputs_config.disable_additional_properties structured_outputs_config.reasoning_parser
        structured_outputs_config.reasoning_parser_plugin structured_outputs_config.enable_in_reasoning
        reasoning_config.reasoning_parser reasoning_config.reasoning_start_str reasoning_config.reasoning_end_str
        reasoning_config._reasoning_start_token_ids reasoning_config._reasoning_end_token_ids
        reasoning_config._natural_reasoning_end_token_ids reasoning_config._enabled""",
    "sleep mode (tested: kvtier rebuilds its device tables on every wake-up)": """
        model_config.enable_sleep_mode model_config.sleep_preserve_parameter_names model_config.sleep_mode_backend
        model_config.enable_nccl_comm_suspend model_config.enable_cumem_allocator""",
    "pool size and block bookkeeping (kvtier sizes from the pool vLLM builds; the layout is probed)": """
        cache_config.user_specified_block_size cache_config.user_specified_mamba_block_size
        cache_config.kv_cache_layout cache_config.gpu_memory_utilization cache_config.num_gpu_blocks_override
        cache_config.num_gpu_blocks cache_config.num_cpu_blocks cache_config.kv_cache_size_tokens
        cache_config.kv_cache_max_concurrency cache_config.kv_cache_memory_bytes cache_config._block_size_resolved
        cache_config.skip_page_size_padded cache_config.kv_cache_dtype_skip_layers""",
    "how prefix-cache blocks are hashed and reported, and KV offloading's backend (offloading is refused; kvtier "
    "decides which blocks are hashed at all, scheduler_side.prefix_cache_caps)": """
        cache_config.prefix_match_unit cache_config.prefix_caching_hash_algo cache_config.prefix_cache_retention_interval
        cache_config.kv_offloading_backend
        kv_events_config.enable_kv_cache_events kv_events_config.publisher kv_events_config.endpoint
        kv_events_config.replay_endpoint kv_events_config.buffer_steps kv_events_config.hwm
        kv_events_config.max_queue_size kv_events_config.topic""",
    "state-space and hybrid models (refused by the one-full-attention-group row)": """
        cache_config.mamba_page_size_padded cache_config.mamba_block_size cache_config.mamba_cache_dtype
        cache_config.mamba_ssm_cache_dtype cache_config.mamba_cache_mode
        cache_config.enable_mamba_shared_prefix_checkpoint cache_config.replayssm_buffer_len
        cache_config.use_replayssm cache_config.use_kda_recoverssm cache_config.swa_bounded_replay
        mamba_config.backend mamba_config.enable_stochastic_rounding mamba_config.stochastic_rounding_philox_rounds
        mamba_config.ssu_algorithm""",
    "data-parallel, expert-parallel and process placement (each rank's cache is its own; experts are MLP "
    "weights)": """
        parallel_config.data_parallel_size_local parallel_config.data_parallel_rank
        parallel_config.data_parallel_rank_local parallel_config.data_parallel_master_ip
        parallel_config.data_parallel_rpc_port parallel_config.dp_sync_interval
        parallel_config.data_parallel_master_port parallel_config.data_parallel_backend
        parallel_config.data_parallel_external_lb parallel_config.data_parallel_hybrid_lb
        parallel_config.disable_nccl_for_dp_synchronization parallel_config.data_parallel_index
        parallel_config._data_parallel_master_port_list parallel_config.is_moe_model
        parallel_config.enable_expert_parallel parallel_config.enable_batch_sharded_sampling
        parallel_config.enable_ep_weight_filter parallel_config.enable_eplb parallel_config.eplb_config
        parallel_config.expert_placement_strategy parallel_config.all2all_backend parallel_config.enable_elastic_ep
        parallel_config.elastic_ep_max_dp_size parallel_config.max_parallel_loading_workers
        parallel_config.disable_custom_all_reduce parallel_config.ray_workers_use_nsight
        parallel_config.ray_runtime_env parallel_config.placement_group parallel_config.distributed_executor_backend
        parallel_config.worker_cls parallel_config.sd_worker_cls parallel_config.worker_extension_cls
        parallel_config.master_addr parallel_config.master_port parallel_config.node_rank parallel_config.nnodes
        parallel_config.numa_bind parallel_config.numa_bind_nodes parallel_config.numa_bind_cpus
        parallel_config.assigned_physical_gpu_ids parallel_config.distributed_timeout_seconds
        parallel_config.cpu_distributed_timeout_seconds parallel_config.world_size parallel_config.rank
        parallel_config._coord_store_port parallel_config._api_process_count parallel_config._api_process_rank
        parallel_config.enable_fault_tolerance parallel_config.fault_tolerance_config
        parallel_config.ubatch_size parallel_config.dbo_decode_token_threshold
        parallel_config.dbo_prefill_token_threshold parallel_config.dcp_kv_cache_interleave_size
        parallel_config.dcp_comm_backend parallel_config.dcp_q_replicate parallel_config.cp_kv_cache_interleave_size
        parallel_config._allow_auto_resolve_cp_interleave_size device_config.device device_config.device_type""",
    "scheduling limits and policy (kvtier's rounds follow whatever vLLM schedules; preemption, chunked prefill "
    "and async scheduling are tested)": """
        scheduler_config.max_num_batched_tokens scheduler_config.max_num_scheduled_tokens scheduler_config.max_num_seqs
        scheduler_config.max_num_active_seqs scheduler_config.long_prefill_token_threshold
        scheduler_config.long_prefill_token_threshold_adaptive scheduler_config.max_num_queued_reqs
        scheduler_config.max_num_queued_tokens scheduler_config.enable_chunked_prefill
        scheduler_config.is_multimodal_model scheduler_config.max_num_encoder_input_tokens
        scheduler_config.encoder_cache_size scheduler_config.policy scheduler_config.disable_chunked_mm_input
        scheduler_config.disable_hybrid_kv_cache_manager scheduler_config.scheduler_reserve_full_isl
        scheduler_config.watermark scheduler_config.prefill_schedule_interval scheduler_config.async_scheduling
        scheduler_config.stream_interval ec_manager_config.encoder_cache_manager_cls ec_manager_config.manager_config
        ec_transfer_config""",
    "attention kernel options of other backends or of MLA / sparse attention (those backends and models are "
    "refused)": """
        attention_config.minimax_m3_msa_decode_backend attention_config.flash_attn_version
        attention_config.flash_attn_max_num_splits_for_cuda_graph attention_config.tq_max_kv_splits_for_cuda_graph
        attention_config.use_trtllm_attention attention_config.disable_flashinfer_q_quantization
        attention_config.mla_prefill_backend attention_config.use_prefill_query_quantization
        attention_config.indexer_kv_dtype attention_config.indexer_sparse_logits attention_config.sparse_mla_force_mqa
        attention_config.flex_attn_block_m attention_config.flex_attn_block_n attention_config.flex_attn_q_block_size
        attention_config.flex_attn_kv_block_size""",
    "compilation of the model's code between attention calls (attention's own graph mode is checked)": """
        compilation_config.mode compilation_config.debug_dump_path compilation_config.cache_dir
        compilation_config.compile_cache_save_format compilation_config.backend compilation_config.custom_ops
        compilation_config.ir_enable_torch_wrap compilation_config.compile_mm_encoder
        compilation_config.cudagraph_mm_encoder compilation_config.encoder_cudagraph_token_budgets
        compilation_config.encoder_cudagraph_max_vision_items_per_batch
        compilation_config.encoder_cudagraph_max_frames_per_batch compilation_config.compile_sizes
        compilation_config.compile_ranges_endpoints compilation_config.inductor_compile_config
        compilation_config.inductor_passes compilation_config.cudagraph_num_of_warmups
        compilation_config.cudagraph_capture_sizes compilation_config.cudagraph_copy_inputs
        compilation_config.cudagraph_specialize_lora compilation_config.use_inductor_graph_partition
        compilation_config.pass_config compilation_config.max_cudagraph_capture_size
        compilation_config.dynamic_shapes_config compilation_config.local_cache_dir
        compilation_config.fast_moe_cold_start compilation_config.enabled_custom_ops
        compilation_config.disabled_custom_ops compilation_config.traced_files compilation_config.compilation_time
        compilation_config.encoder_compilation_time compilation_config.static_forward_context
        compilation_config.static_all_moe_layers optimization_level performance_mode
        kernel_config.ir_op_priority kernel_config.enable_flashinfer_autotune kernel_config.enable_cutedsl_warmup
        kernel_config.enable_jit_warmup kernel_config.moe_backend kernel_config.sparse_indexer_topk_backend
        kernel_config.linear_backend kernel_config.linear_backend_per_quant""",
    "observability, logging, profiling and process identity": """
        observability_config.show_hidden_metrics_for_version observability_config.otlp_traces_endpoint
        observability_config.collect_detailed_traces observability_config.per_request_spec_decode_metrics
        observability_config.kv_cache_metrics observability_config.kv_cache_metrics_sample
        observability_config.cudagraph_metrics observability_config.enable_layerwise_nvtx_tracing
        observability_config.enable_mfu_metrics observability_config.enable_mm_processor_stats
        observability_config.enable_logging_iteration_details observability_config.jit_monitor_mode
        observability_config.jit_monitor_verbose logging_config.log_level logging_config.configure_logging
        logging_config.pylogging_config_file profiler_config instance_id shutdown_timeout additional_config""",
    "added in vLLM 0.32: sleep-mode graph backup, HyperConnection sequence parallelism (Qwen4Exp), the shared-"
    "memory tensor transport, kernels of MLA or ROCm backends (refused), YOCO decoder-replay graphs (sliding-window "
    "models only, refused), and logging": """
        model_config.sleep_mode_offload_cudagraph parallel_config.enable_hc_sp parallel_config.enable_shm_tensor_arena
        attention_config.tokenspeed_mla_min_split_kv attention_config.sparse_mla_prefill_workspace_factor
        kernel_config.enable_rocm_segmented_attn_autotune compilation_config.cudagraph_decoder_replay
        compilation_config.decoder_replay_cudagraph_capture_sizes compilation_config.decoder_replay_trim_threshold
        observability_config.custom_histogram_buckets logging_config.formatter""",
}

NEUTRAL: dict[str, str] = {path: why for why, paths in _NEUTRAL_GROUPS.items() for path in paths.split()}


def unclassified() -> list[str]:
    """Fields of the installed vLLM's VllmConfig (and its dataclass sub-configs) in neither CHECKED nor
    NEUTRAL. A sub-config classified as a whole (e.g. `profiler_config`) covers its fields."""
    import dataclasses
    import typing

    from vllm.config import VllmConfig

    hints = typing.get_type_hints(VllmConfig)
    out = []
    for f in dataclasses.fields(VllmConfig):
        if f.name in CHECKED or f.name in NEUTRAL:
            continue
        sub = next((t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                    if isinstance(t, type) and dataclasses.is_dataclass(t)), None)
        if sub is None:
            out.append(f.name)
            continue
        out += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)
                if f"{f.name}.{g.name}" not in CHECKED and f"{f.name}.{g.name}" not in NEUTRAL]
    return out
