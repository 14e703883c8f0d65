"""What the compressed engine refuses: unsupported engine features (at start-up, in the caller's
process) and bad per-request eviction parameters (in the frontend, before the engine core)."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from .config import REQUEST_KEYS, EngineEvictionConfig, EvictionConfigError, resolve_request_spec, validate_request


class UnsupportedEngineConfig(EvictionConfigError):
    pass


class KVTierRequestError(VLLMValidationError, ValueError):
    """A request's kvtier parameters are invalid (HTTP 400 through vLLM's API server)."""


def check_supported(vllm_config, kv_cache_config=None) -> None:
    cfg = EngineEvictionConfig.from_vllm(vllm_config)
    if cfg is None:
        return
    problems = []
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append("prefix caching (compaction rewrites block contents): pass enable_prefix_caching=False")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (pipeline_parallel_size > 1)")
    mc = vllm_config.model_config
    if mc.use_mla:
        problems.append("MLA attention models")
    if mc.get_sliding_window() is not None or getattr(mc.hf_text_config, "layer_types", None) and any(
            "sliding" in str(t) for t in mc.hf_text_config.layer_types):
        problems.append("sliding-window attention models")
    if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        problems.append(f"quantized KV cache (kv_cache_dtype={vllm_config.cache_config.cache_dtype})")
    if kv_cache_config is not None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            problems.append("models whose KV cache is not one full-attention group (hybrid/sliding/MLA)")
    if problems:
        raise UnsupportedEngineConfig(
            "kvtier eviction (additional_config.kvtier) cannot run with: " + "; ".join(problems))


def validate_engine_request(vllm_config, request) -> None:
    sp = getattr(request, "sampling_params", None)
    extra = (sp.extra_args if sp is not None else None) or {}
    asked = [k for k in extra if k.startswith("kvtier_")]
    cfg = EngineEvictionConfig.from_vllm(vllm_config)
    if cfg is None:
        if asked:
            raise KVTierRequestError(f"kvtier parameters {asked} sent to an engine without kvtier eviction "
                                     "(start it with additional_config={'kvtier': {...}})", parameter=asked[0])
        return
    try:
        spec = resolve_request_spec(cfg.default, extra)
        mc = vllm_config.model_config
        validate_request(spec, len(request.prompt_token_ids or ()), num_layers=mc.get_total_num_hidden_layers(),
                         num_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size())
    except EvictionConfigError as exc:
        raise KVTierRequestError(str(exc), parameter=next(iter(asked), None)) from None


__all__ = ["check_supported", "validate_engine_request", "UnsupportedEngineConfig", "KVTierRequestError", "REQUEST_KEYS"]
