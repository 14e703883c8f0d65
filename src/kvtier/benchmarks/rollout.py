"""`kvtier bench rollout`: the rollout phase of one long-CoT batch through verl's agent loop on the kvtier
backend (rollout.name=kvtier: verl's `AgentLoopManager` and single-turn agent loop driving `KVTierReplica`'s
server, as `kvtier.rollout.cpu.local.LocalRollout` builds them), compressed (budget K) vs full attention.

Both arms run on ONE server engine, so one KV pool (sized for `full_seqs` full-length sequences): the
engine's training default is the compressed policy; the full arm is the same batch sent the way verl's
trainer sends validation batches (meta_info validate=True), which kvtier's agent-loop manager runs at
`val_budget: full` (per-request `kvtier_budget=full`), with `val_kwargs` set to the training sampling so the
budget is the only difference. ignore_eos: every sample generates exactly `gen_tokens` tokens.

Preemptions come from vLLM's own iteration stats (every request, full attention included) through a stat
logger added to the server's AsyncLLM; eviction events from kvtier's engine counters. One compressed sample
warms the agent loop and the engine's eviction path up first; then the compressed arm, then the full arm.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass

from vllm.v1.metrics.loggers import StatLoggerBase

from kvtier.engine import compat

from .harness import TINY_BLOCK_BYTES, TINY_BLOCK_TOKENS

TARGETS = {"ratio_min": 2.0, "compressed_preemptions": 0}


@dataclass(frozen=True)
class RolloutShape:
    samples: int = 20              # the pool holds 22 compressed (K=256, r=64) samples at once: all of them
    gen_tokens: int = 2048
    prompt_length: int = 128        # data.max_prompt_length; the chat prompts are shorter
    budget: int = 256
    buffer: int = 64
    policy: str = "random"
    full_seqs: int = 4              # the pool holds this many (prompt_length + gen_tokens) sequences
    kv_bytes: int | None = None     # overrides full_seqs
    temperature: float = 1.0
    server_cpus: int | None = None  # Ray CPUs (= engine threads) of the server actor; None = all cores

    def threads(self) -> int:
        return self.server_cpus or os.cpu_count() or 1

    def pool_bytes(self) -> int:
        if self.kv_bytes:
            return self.kv_bytes
        per_seq = -(-(self.prompt_length + self.gen_tokens) // TINY_BLOCK_TOKENS)
        return (self.full_seqs * per_seq + 1) * TINY_BLOCK_BYTES   # + vLLM's null block


class StepCounter(StatLoggerBase):
    """A vLLM stat logger (lives in the server actor): preemptions and the peak running batch, all requests."""

    def __init__(self) -> None:
        self.preemptions = self.peak_running = self.steps = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        if scheduler_stats is not None:
            self.steps += 1
            self.peak_running = max(self.peak_running, scheduler_stats.num_running_reqs)

    def log_engine_initialized(self) -> None:
        pass


def _install_counter(server) -> dict:
    """(Runs in the server actor.) Add a StepCounter to the AsyncLLM; the pool it got."""
    manager = compat.stat_logger_manager(server.engine)
    if manager is None:
        raise RuntimeError("the rollout server's AsyncLLM has no stat loggers (disable_log_stats must be false)")
    server._bench_counter = StepCounter()
    compat.stat_loggers(manager).append(server._bench_counter)
    cache = server.engine.vllm_config.cache_config
    return {"blocks": (cache.num_gpu_blocks or 1) - 1, "block_size": cache.block_size}   # minus the null block


def _take_counter(server) -> dict:
    """(Runs in the server actor.) The counter's values since the last take."""
    c = server._bench_counter
    out = {"preemptions": c.preemptions, "peak_running": c.peak_running, "steps": c.steps}
    c.preemptions = c.peak_running = c.steps = 0
    return out


def rollout_overrides(model: str, s: RolloutShape) -> list[str]:
    from kvtier.rollout.verl_config import cpu_rollout_overrides

    r = "actor_rollout_ref.rollout"
    return cpu_rollout_overrides(
        model, budget=s.budget, buffer=s.buffer, policy=s.policy, prompt_length=s.prompt_length,
        response_length=s.gen_tokens, kv_cache_bytes=s.pool_bytes(), temperature=s.temperature,
        max_num_seqs=max(s.samples, 4), val_budget="full") + [
        f"{r}.ignore_eos=true",
        f"{r}.disable_log_stats=false",            # vLLM's iteration stats: preemptions of every request
        f"{r}.val_kwargs.temperature={s.temperature}",
        f"{r}.val_kwargs.do_sample=true",
        f"{r}.custom.kvtier.server_num_cpus={s.threads()}",
    ]


def _run_arm(rollout, prompts: list[str], validate: bool) -> dict:
    import ray

    from kvtier.rollout.cpu.local import chat_batch
    from kvtier.rollout.metrics import per_sample_stats

    server = rollout.server
    before = ray.get(server.eviction_stats.remote())["engine"]
    ray.get(server.__ray_call__.remote(_take_counter))
    batch = chat_batch(prompts, validate=validate)
    t0 = time.perf_counter()
    out = rollout.generate_sequences(batch)
    seconds = time.perf_counter() - t0
    steps = ray.get(server.__ray_call__.remote(_take_counter))
    after = ray.get(server.eviction_stats.remote())["engine"]
    rows = per_sample_stats(out)
    lengths = [r["response_tokens"] for r in rows]
    tokens = sum(lengths)
    plen = out.batch["prompts"].shape[1]
    prompt_tokens = out.batch["attention_mask"][:, :plen].sum(-1).tolist()
    compressed = [r["kvtier_preemptions"] for r in rows if r["kvtier_budget"] is not None]
    return {
        "seconds": seconds, "tok_per_s": tokens / seconds, "generated_tokens": tokens,
        "preemptions": steps["preemptions"],
        # kvtier's own per-sample counter (compressed samples only; None for a full-attention arm)
        "preemptions_compressed": sum(compressed) if compressed else None,
        "eviction_events": after["events"] - before["events"],
        "tokens_evicted_per_head": after["tokens_evicted"] - before["tokens_evicted"],
        "blocks_freed": after["blocks_freed"] - before["blocks_freed"],
        "peak_running": steps["peak_running"], "engine_steps": steps["steps"],
        "budgets": sorted({r["kvtier_budget"] for r in rows}, key=str),
        "response_tokens": {"min": min(lengths), "max": max(lengths)},
        "prompt_tokens": {"min": int(min(prompt_tokens)), "max": int(max(prompt_tokens))},
    }


def run_rollout_bench(model: str, s: RolloutShape) -> dict:
    import ray

    from kvtier.rollout.cpu.demo import demo_prompts
    from kvtier.rollout.cpu.local import LocalRollout, chat_batch, init_local_ray
    from kvtier.rollout.verl_config import compose_config

    config = compose_config(rollout_overrides(model, s))
    prompts = demo_prompts(s.samples)
    load_before = os.getloadavg()[0]     # the machine may be shared: its load frames the timings
    t0 = time.perf_counter()
    started = init_local_ray(num_cpus=s.threads() + 2)    # + the agent-loop worker and spare
    rollout = None
    try:
        with contextlib.redirect_stdout(sys.stderr):     # verl prints its server list; stdout stays JSON
            rollout = LocalRollout(config)
        pool = ray.get(rollout.server.__ray_call__.remote(_install_counter))
        startup_s = time.perf_counter() - t0
        # one compressed sample first: the agent loop's first call and the engine's first eviction rounds cost
        # seconds once (measured ~15 s on 2 CPU cores), a trainer pays them once per run, not per batch
        t1 = time.perf_counter()
        rollout.generate_sequences(chat_batch(prompts[:1]))
        warmup_s = time.perf_counter() - t1
        arms = {s.policy: _run_arm(rollout, prompts, validate=False), "full": _run_arm(rollout, prompts, validate=True)}
    finally:
        if rollout is not None:
            rollout.close()
        if started:
            ray.shutdown()
    comp, full = arms[s.policy], arms["full"]
    per_seq = -(-(s.prompt_length + s.gen_tokens) // pool["block_size"])
    kept = -(-min(s.prompt_length + s.gen_tokens, s.budget + 2 * s.buffer) // pool["block_size"])
    checks = {
        "equal_generated_tokens": comp["generated_tokens"] == full["generated_tokens"] == s.samples * s.gen_tokens,
        "compressed_evicted": comp["eviction_events"] > 0,
        "full_not_evicted": full["eviction_events"] == 0 and full["budgets"] == [None],
    }
    ratio = comp["tok_per_s"] / full["tok_per_s"]
    return {
        "arms": {"full": full, s.policy: comp},
        "ratio": ratio,
        "workload": {
            **asdict(s), "model": model, "kv_bytes": s.pool_bytes(), "pool": pool,
            # what the pool holds at once, by block arithmetic
            "concurrent_by_blocks": {"full": pool["blocks"] // per_seq, s.policy: pool["blocks"] // kept},
            "path": "verl AgentLoopManager (KVTierAgentLoopManager) -> single_turn_agent -> KVTierReplica server "
                    "(one AsyncLLM, one KV pool); full arm = validate batch at val_budget=full",
            "arm_order": [s.policy, "full"], "startup_s": startup_s, "warmup_s": warmup_s,
            "server_threads": s.threads(),
        },
        "host": {"cpus": os.cpu_count(), "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]},
        "targets": TARGETS,
        "meets_targets": ratio >= TARGETS["ratio_min"] and comp["preemptions"] == TARGETS["compressed_preemptions"],
        "checks": checks,
        "valid": all(checks.values()),
    }
