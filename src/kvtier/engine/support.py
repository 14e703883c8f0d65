"""What the compressed engine refuses: unsupported engine features (at start-up, in the caller's
process) and bad per-request eviction parameters (in the frontend, before the engine core).

"Never silently wrong": kvtier's worker patches target vLLM's V1 `GPUModelRunner` (the CPU runner inherits
it) and capture queries through a Python wrapper on each attention layer's `impl.forward`. With eviction
configured the engine runs only in configurations that are tested; anything else is refused here with a
message naming the setting, or overridden with one WARNING line on logger "kvtier.engine" (the V1 model
runner, see patch_worker.use_v2_model_runner).
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from .allowlist import captured_needs, full_cudagraph_setting, v2_model_runner_conflict, violations
from .config import REQUEST_KEYS, EngineEvictionConfig, EvictionConfigError, resolve_request_spec, validate_request


class UnsupportedEngineConfig(EvictionConfigError):
    pass


V2_ADVICE = "VLLM_USE_V2_MODEL_RUNNER=1"


def v2_refusal(vllm_message: str) -> str:
    """vLLM's advice to switch to Model Runner V2, and why that is no way out with kvtier, in one message."""
    return (f"{vllm_message.rstrip('.')} -- but this engine runs kvtier eviction (additional_config.kvtier), "
            f"which patches the V1 model runner and refuses {V2_ADVICE}: the feature is not available with "
            "kvtier eviction (tested configurations: `kvtier engine supported`)")


class KVTierRequestError(VLLMValidationError, ValueError):
    """A request's kvtier parameters are invalid (HTTP 400 through vLLM's API server)."""


def check_supported(vllm_config, kv_cache_config=None) -> None:
    """Refuse an engine with kvtier eviction whose config is off the tested table (allowlist.TESTED),
    naming every setting that is, in one message."""
    if EngineEvictionConfig.from_vllm(vllm_config) is None:
        return
    problems = violations(vllm_config, kv_cache_config)
    if problems:
        raise UnsupportedEngineConfig(
            "kvtier eviction (additional_config.kvtier) cannot run with: " + "; ".join(problems)
            + " (tested configurations: `kvtier engine supported`)")


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
        reads = captured_needs(spec.policy) if graphs is not None else frozenset()
        if reads:
            raise KVTierRequestError(
                f"kvtier_policy {spec.policy!r} reads {sorted(reads)}, which kvtier captures in Python inside "
                f"attention; this engine runs {graphs}, which does not replay that Python. Use a policy that "
                "reads no queries/attention (e.g. random) or an engine started with "
                "compilation_config={'cudagraph_mode': 'PIECEWISE'} (or enforce_eager=True)",
                parameter="kvtier_policy" if "kvtier_policy" in extra else next(iter(asked), None))


__all__ = ["check_supported", "validate_engine_request", "UnsupportedEngineConfig", "KVTierRequestError",
           "REQUEST_KEYS", "v2_model_runner_conflict", "full_cudagraph_setting"]
