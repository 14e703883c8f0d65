"""`max_num_seqs: auto`: a batch limit sized so the bounded tiers can use the memory their bound frees.

A fixed cap (vLLM's CPU default, or the 16 the first local config had) wastes a compressed engine: a request
in tier t never holds more than prompt + K + 2r tokens (the router admits a prompt only up to
(1 - min_trace_share) * K, and a round runs at K + 2r), so the pool holds total_blocks / that many blocks of
such requests at once. `auto` sets max_num_seqs to that count for the engine's smallest-budget auto tier
(capped at MAX_AUTO_SEQS), so memory, not the batch cap, is the limit. Full-attention requests on the same
engine are still bounded by the pool: vLLM admits them only while their blocks fit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import EngineConfig, ServiceConfig

MAX_AUTO_SEQS = 256            # vLLM's own default batch limit on a GPU under 70 GiB (1024 on H100/H200)
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 128, 16   # vLLM 0.31's default block sizes per platform
# Bytes per KV value for the model dtypes an engine may be given (the KV cache follows the model's dtype).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_bytes_per_token(model: str | Path | Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers (bfloat16 unless told), from a model directory's config.json or
    a config given as a mapping (e.g. kvtier.models.tiny.TINY_CONFIG)."""
    hf = model if isinstance(model, Mapping) else json.loads((Path(model) / "config.json").read_text())
    hf = hf.get("text_config", hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    return hf["num_hidden_layers"] * kv_heads * head_dim * 2 * dtype_bytes


def block_size(eng: EngineConfig) -> int:
    """The engine's KV block size: its engine_kwargs' block_size, else vLLM's default on its platform."""
    return int(eng.engine_kwargs.get("block_size") or (CPU_BLOCK_SIZE if eng.accelerator == "cpu" else GPU_BLOCK_SIZE))


def engine_dtype(eng: EngineConfig) -> tuple[str | None, str | None]:
    """(dtype, why) the engine runs: its engine_kwargs.dtype unless that is `auto` or absent, which is float32
    on a CPU without native bf16 (why: one log line) and otherwise None, the model's own dtype."""
    from kvtier.engine.cpu_dtype import resolve_dtype

    return resolve_dtype(eng.engine_kwargs.get("dtype"), eng.accelerator)


def pool_blocks(eng: EngineConfig, model: str | Path | Mapping[str, Any], kv_bytes: int) -> int:
    """Blocks of the engine's block size that kv_bytes of its model's KV cache hold (in its dtype)."""
    dtype_bytes = DTYPE_BYTES.get(engine_dtype(eng)[0] or "bfloat16", 2)
    return kv_bytes // (kv_bytes_per_token(model, dtype_bytes) * block_size(eng))


def auto_max_num_seqs(cfg: ServiceConfig, engine: str, model_path: str) -> tuple[int | None, str]:
    """(max_num_seqs, why) for an engine whose engine_kwargs say `max_num_seqs: auto`; (None, why) leaves
    vLLM's default (no fixed KV size to divide, or no compressed tier).

    Without kv_cache_bytes (GPU engines: vLLM sizes the pool from gpu_memory_utilization once it has profiled
    the model on the GPU, after max_num_seqs is fixed, and a worker group may mix GPU sizes) there is nothing to
    divide here: vLLM 0.31's default, 1024 on GPUs of 70 GiB or more such as H100 and H200, is above what
    their pools hold at any compressed tier (docs/deploy.md "KV capacity per GPU"), so memory binds anyway."""
    eng = cfg.engines[engine]
    tiers = sorted((t for t in cfg.tiers if t.engine == engine and t.bound_budget and t.auto), key=lambda t: t.bound_budget)
    if eng.kv_cache_bytes is None or not tiers:
        return None, "vLLM's default (no kv_cache_bytes or no compressed auto tier to size from)"
    block = block_size(eng)
    total_blocks = pool_blocks(eng, model_path, eng.kv_cache_bytes)
    t = tiers[0]
    k = t.bound_budget
    bound = int((1.0 - cfg.routing.min_trace_share) * k) + k + 2 * t.buffer
    per_request = math.ceil(bound / block)
    seqs = max(1, min(MAX_AUTO_SEQS, total_blocks // per_request))
    return seqs, (f"{total_blocks} blocks of {block} tokens / {per_request} per {t.name} request "
                  f"(prompt <= {bound - k - 2 * t.buffer} + K {k} + 2r {2 * t.buffer})"
                  + (f", capped at {MAX_AUTO_SEQS}" if seqs == MAX_AUTO_SEQS else ""))


def resolved_engine_kwargs(cfg: ServiceConfig, engine: str, model_path: str) -> tuple[dict, str | None]:
    """The engine's vLLM kwargs with `max_num_seqs: auto` and `dtype: auto` (or absent) resolved, and the
    reasons joined by '; ' for the start-up log (None when nothing was resolved)."""
    kwargs = dict(cfg.engines[engine].engine_kwargs)
    notes = []
    dtype, why = engine_dtype(cfg.engines[engine])
    kwargs.pop("dtype", None)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if why:
        notes.append(why)
    if kwargs.get("max_num_seqs") == "auto":
        seqs, why = auto_max_num_seqs(cfg, engine, model_path)
        kwargs.pop("max_num_seqs")
        if seqs is not None:
            kwargs["max_num_seqs"] = seqs
        notes.insert(0, f"max_num_seqs auto = {seqs if seqs is not None else 'vLLM default'}: {why}")
    return kwargs, "; ".join(notes) or None
