"""`kvtier bench capacity`: the most concurrent sequences a KV pool holds without preemption, full attention
vs compressed, measured on the engine (all N running at once, zero preemptions) and compared with the
block arithmetic (pool blocks // blocks per sequence).

`--gpu H100 --gpu H200` runs the arithmetic alone (`gpu_capacity`): the KV pool vLLM's
gpu_memory_utilization leaves on each GPU, and how many traces of each tier of a service config it holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .harness import TINY_BLOCK_BYTES, StepObserver, build_bench_engine, prompts_of, run_load

if TYPE_CHECKING:
    from kvtier.service.config import ServiceConfig


@dataclass(frozen=True)
class CapacityShape:
    prompt_tokens: int = 64
    gen_tokens: int = 640
    budget: int = 256
    buffer: int = 64
    policy: str = "random"
    kv_bytes: int = 33 * TINY_BLOCK_BYTES   # 32 usable blocks


def _fits(llm, obs: StepObserver, n: int, s: CapacityShape, extra) -> bool:
    from vllm import SamplingParams

    obs.reset()
    params = SamplingParams(max_tokens=s.gen_tokens, temperature=0, ignore_eos=True, extra_args=extra)
    run_load(llm, prompts_of(n, s.prompt_tokens, seed=n), params)
    return obs.preemptions == 0 and obs.peak_running == n


def _largest(llm, obs, s, extra, hi: int) -> int:
    lo = 0  # invariant: lo fits, hi + 1 does not (hi is an upper bound we verify downward)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(llm, obs, mid, s, extra):
            lo = mid
        else:
            hi = mid - 1
    return lo


def run_capacity_bench(model: str, s: CapacityShape) -> dict:
    from kvtier.engine.api import eviction_stats, pool_state, sampling_extra_args

    # Stock admission: a sequence that does not fit shows up as a preemption, for both arms.
    llm = build_bench_engine(model, s.kv_bytes, s.prompt_tokens + s.gen_tokens + 8, 512, s.buffer, admission="vllm")
    obs = StepObserver().attach(llm)
    pool = pool_state(llm)
    bs = pool["block_size"]
    full_blocks = -(-(s.prompt_tokens + s.gen_tokens) // bs)
    comp_blocks = -(-min(s.prompt_tokens + s.gen_tokens, max(s.prompt_tokens, s.budget + 2 * s.buffer)) // bs)
    predicted = {"full": pool["total_blocks"] // full_blocks, "compressed": pool["total_blocks"] // comp_blocks}
    extra = sampling_extra_args(budget=s.budget, policy=s.policy, buffer=s.buffer)
    before = eviction_stats(llm)["engine"]["events"]
    measured = {
        "full": _largest(llm, obs, s, None, 2 * predicted["full"] + 2),
        "compressed": _largest(llm, obs, s, extra, 2 * predicted["compressed"] + 2),
    }
    events = eviction_stats(llm)["engine"]["events"] - before
    return {
        "model": model, "shape": asdict(s), "pool": pool,
        "blocks_per_sequence": {"full": full_blocks, "compressed": comp_blocks},
        "predicted": predicted, "measured": measured,
        "capacity_ratio": measured["compressed"] / max(measured["full"], 1),
        # within one block per sequence: measured * blocks must land within n blocks of the pool
        "matches_block_arithmetic": {k: abs(measured[k] - predicted[k]) * (full_blocks if k == "full" else comp_blocks)
                                     <= max(measured[k], 1) for k in measured},
        "eviction_events": events, "valid": events > 0,
    }


# -- arithmetic only: traces per KV pool on a GPU, per tier -----------------------------------------------
MIB, GIB = 1 << 20, 1 << 30
# Total memory as CUDA reports it (nvidia-smi, MiB): the whole that gpu_memory_utilization is a share of.
GPU_MEMORY = {"H100": 81559 * MIB, "H200": 143771 * MIB}
# Qwen3-8B (gpu.yaml's model): the KV shape from its config.json, and its bf16 weights (8,190,735,360
# parameters: embeddings and lm_head 151936 x 4096 each, 36 layers of 192,946,432).
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 4096}
QWEN3_8B_WEIGHT_BYTES = 8_190_735_360 * 2
# What vLLM's profile finds besides the weights before it sizes the pool (activations at
# max_num_batched_tokens, CUDA graphs, the CUDA context): an assumption; vLLM logs the real figure at start
# ("Available KV cache memory").
OVERHEAD_BYTES = 3 * GIB


def gpu_kv_bytes(gpu_bytes: int, utilization: float, weights_bytes: int, overhead_bytes: int = OVERHEAD_BYTES) -> int:
    """vLLM's gpu_memory_utilization sizing: the KV pool is the GPU's share less the weights and the rest of
    the profiled peak."""
    return int(gpu_bytes * utilization) - weights_bytes - overhead_bytes


def tier_capacity(cfg: ServiceConfig, engine: str, model: Mapping[str, Any], kv_bytes: int, trace_tokens: int) -> dict:
    """Traces of `trace_tokens` (prompt + generation) that `kv_bytes` of the engine's pool holds at once, per
    tier on the engine: pool blocks // the blocks reserve admission holds for one trace
    (`EvictionSpec.max_blocks`, the prompt as long as the router lets into the tier)."""
    from kvtier.service.routing import prompt_room
    from kvtier.service.sizing import block_size, pool_blocks

    eng = cfg.engines[engine]
    block, total = block_size(eng), pool_blocks(eng, model, kv_bytes)
    tiers = {}
    for t in (t for t in cfg.tiers if t.engine == engine):
        prompt = prompt_room(t, cfg.routing.min_trace_share) if t.bound_budget else 0
        spec = t.spec.tightened() if t.elastic else t.spec       # an elastic tier at its floor: what fits at most
        blocks = spec.max_blocks(prompt, trace_tokens - prompt, block)
        tiers[t.name] = {"budget": t.budget, "blocks_per_trace": blocks, "traces": total // blocks}
    return {"kv_bytes": kv_bytes, "block_size": block, "pool_blocks": total, "tiers": tiers}


def gpu_capacity(cfg: ServiceConfig, gpus: list[str], model: Mapping[str, Any] = QWEN3_8B,
                 weights_bytes: int = QWEN3_8B_WEIGHT_BYTES, overhead_bytes: int = OVERHEAD_BYTES,
                 trace_tokens: int | None = None) -> dict:
    """`tier_capacity` of every engine of `cfg` on each GPU, its pool sized as vLLM sizes it there (the
    engine's gpu_memory_utilization, vLLM's 0.9 by default)."""
    out = {}
    for gpu in gpus:
        out[gpu] = {}
        for name, eng in cfg.engines.items():
            util = float(eng.engine_kwargs.get("gpu_memory_utilization", 0.9))
            kv = gpu_kv_bytes(GPU_MEMORY[gpu], util, weights_bytes, overhead_bytes)
            out[gpu][name] = {"gpu_memory_utilization": util,
                              **tier_capacity(cfg, name, model, kv, trace_tokens or eng.max_model_len)}
    return {"assumptions": {"gpu_memory": {g: GPU_MEMORY[g] for g in gpus}, "weights_bytes": weights_bytes,
                            "overhead_bytes": overhead_bytes, "model": dict(model),
                            "trace_tokens": trace_tokens or "each engine's max_model_len"},
            "gpus": out}


def capacity_markdown(report: dict) -> str:
    """The docs' table of a `gpu_capacity` report: one row per tier, traces per pool on each GPU."""
    gpus = list(report["gpus"])
    first = report["gpus"][gpus[0]]
    head = ["tier", "engine", "blocks per trace"] + [f"{g}: traces per pool" for g in gpus]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, cap in first.items():
        for tier, c in cap["tiers"].items():
            rows.append(f"| {tier} | {engine} | {c['blocks_per_trace']} | "
                        + " | ".join(str(report["gpus"][g][engine]["tiers"][tier]["traces"]) for g in gpus) + " |")
    pools = [f"{g}: {kv / GIB:.1f} GiB, {n} blocks of {b}" for g in gpus   # one per distinct pool
             for kv, n, b in sorted({(c["kv_bytes"], c["pool_blocks"], c["block_size"])
                                     for c in report["gpus"][g].values()})]
    return "\n".join(rows) + f"\n\nKV pool per engine replica: {'; '.join(pools)}.\n"
