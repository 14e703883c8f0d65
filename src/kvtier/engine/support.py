"""What the compressed engine refuses: unsupported engine features (at start-up, in the caller's
process) and bad per-request eviction parameters (in the frontend, before the engine core).

"Never silently wrong": kvtier's worker patches target vLLM's V1 `GPUModelRunner` (the CPU runner inherits
it) and capture queries through a Python wrapper on each attention layer's `impl.forward`. With eviction
configured the engine runs only in configurations that are tested; anything else is refused here with a
message naming the setting, or overridden with one WARNING line on logger "kvtier.engine" (the V1 model
runner, see patches._use_v2_model_runner).
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from kvtier.policies import PolicyError, policy_class
from kvtier.policies.base import ATTENTION, QUERIES

from .config import REQUEST_KEYS, EngineEvictionConfig, EvictionConfigError, resolve_request_spec, validate_request

# What the Python query-capture wrapper feeds: policies declaring these need it to run on every decode step.
PYTHON_CAPTURED_NEEDS = frozenset({QUERIES, ATTENTION})
# vLLM's attention custom op (CUDA/ROCm/XPU/CPU register attention as one opaque op). Under piecewise CUDA
# graphs it is a splitting op: vLLM 0.31's CompilationConfig.set_splitting_ops_for_v1 defaults
# splitting_ops to `_attention_ops` (which include it), the captured pieces are the code *between*
# attention calls, and the op itself runs eagerly each step -> unified_attention_with_output ->
# layer.impl.forward, i.e. through kvtier's wrapper. So PIECEWISE (and NONE) keep the capture working;
# only a FULL decode graph (or piecewise graphs whose splitting_ops omit attention) replays attention
# without the Python wrapper. (Under piecewise graphs the query the wrapper sees is a graph-owned buffer that
# the next replay overwrites: the capture copies it into per-request state, it keeps no view.) The check
# reads the config as create_engine_config leaves it; the V1 runner may still lower cudagraph_mode when
# the attention backend cannot do full graphs, never raise it, so the check errs only towards refusing.
ATTENTION_SPLITTING_OP = "vllm::unified_attention_with_output"


class UnsupportedEngineConfig(EvictionConfigError):
    pass


class KVTierRequestError(VLLMValidationError, ValueError):
    """A request's kvtier parameters are invalid (HTTP 400 through vLLM's API server)."""


def v2_model_runner_conflict(vllm_config) -> str | None:
    """Why this config cannot run on the V1 model runner kvtier patches, or None. Only what forces Model
    Runner V2 (vLLM 0.31 `VllmConfig.use_v2_model_runner`): an explicit VLLM_USE_V2_MODEL_RUNNER=1, HiSparse
    or watermarking. vLLM's *default* choice of V2 (GPU with Triton) is overridden, not refused."""
    import vllm.envs as envs

    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
        return ("attention_config.hisparse_config (HiSparse requires vLLM's Model Runner V2; kvtier patches "
                "the V1 GPUModelRunner only)")
    if getattr(vllm_config, "watermark_config", None) is not None:
        return ("watermark_config (watermarking requires vLLM's Model Runner V2; kvtier patches the V1 "
                "GPUModelRunner only)")
    if envs.VLLM_USE_V2_MODEL_RUNNER is True:
        return ("VLLM_USE_V2_MODEL_RUNNER=1 (kvtier patches the V1 GPUModelRunner only): unset it or set "
                "VLLM_USE_V2_MODEL_RUNNER=0")
    return None


def full_cudagraph_setting(vllm_config) -> str | None:
    """The setting under which attention runs inside a CUDA graph (so kvtier's Python query capture is not
    replayed), or None. On CPU cudagraph_mode is NONE."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if not mode:  # None or CUDAGraphMode.NONE (falsy)
        return None
    if mode.has_full_cudagraphs():
        return f"compilation_config.cudagraph_mode={mode.name} (full CUDA graphs)"
    if mode.has_piecewise_cudagraphs() and cc.splitting_ops is not None \
            and ATTENTION_SPLITTING_OP not in cc.splitting_ops:
        return (f"compilation_config.cudagraph_mode={mode.name} with splitting_ops {cc.splitting_ops} "
                f"(attention inside piecewise CUDA graphs; keep {ATTENTION_SPLITTING_OP!r} in splitting_ops)")
    return None


def _captured_needs(policy: str) -> frozenset[str]:
    return frozenset(policy_class(policy).needs) & PYTHON_CAPTURED_NEEDS


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
    v2 = v2_model_runner_conflict(vllm_config)
    if v2 is not None:
        problems.append(v2)
    graphs = full_cudagraph_setting(vllm_config)
    if graphs is not None:
        try:
            reads = _captured_needs(cfg.default.policy)
        except PolicyError as exc:
            problems.append(f"default policy: {exc}")
        else:
            if reads:
                problems.append(
                    f"{graphs} with default policy {cfg.default.policy!r}, which reads {sorted(reads)} that "
                    "kvtier captures in Python inside attention (not replayed by CUDA graphs): pass "
                    "compilation_config={'cudagraph_mode': 'PIECEWISE'} or enforce_eager=True, or serve "
                    "only policies that read no queries/attention (e.g. random, recency)")
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
        # The frontend validates against the model's TOTAL KV heads (what a calibration / request names).
        # Under tensor parallelism each worker holds only its local heads (total // tp_size, see
        # ModelConfig.get_num_kv_heads(parallel_config)); the worker side slices per rank.
        validate_request(spec, len(request.prompt_token_ids or ()), num_layers=mc.get_total_num_hidden_layers(),
                         num_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size())
    except EvictionConfigError as exc:
        raise KVTierRequestError(str(exc), parameter=next(iter(asked), None)) from None
    if spec.compressed:
        graphs = full_cudagraph_setting(vllm_config)
        reads = _captured_needs(spec.policy) if graphs is not None else frozenset()
        if reads:
            raise KVTierRequestError(
                f"kvtier_policy {spec.policy!r} reads {sorted(reads)}, which kvtier captures in Python inside "
                f"attention; this engine runs {graphs}, which does not replay that Python. Use a policy that "
                "reads no queries/attention (e.g. random) or an engine started with "
                "compilation_config={'cudagraph_mode': 'PIECEWISE'} (or enforce_eager=True)",
                parameter="kvtier_policy" if "kvtier_policy" in extra else next(iter(asked), None))


__all__ = ["check_supported", "validate_engine_request", "UnsupportedEngineConfig", "KVTierRequestError",
           "REQUEST_KEYS", "v2_model_runner_conflict", "full_cudagraph_setting"]
