"""`kvtier bench capacity`: the most concurrent sequences a KV pool holds without preemption, full attention
vs compressed, measured on the engine (all N running at once, zero preemptions) and compared with the
block arithmetic (pool blocks // blocks per sequence)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .harness import TINY_BLOCK_BYTES, StepObserver, build_bench_engine, prompts_of, run_load


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
