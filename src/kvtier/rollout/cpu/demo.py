"""`kvtier rollout demo`: a batch of rollouts through verl's rollout path on the compressed engine (CPU).

DataProto in (chat prompts) -> verl `AgentLoopManager.generate_sequences` -> `LLMServerClient` ->
`KVTierServer.generate` (AsyncLLM + kvtier eviction) -> DataProto out (responses, rollout_log_probs,
per-sample eviction columns). Prints one line per sample and the reduced metrics.
"""

from __future__ import annotations

import json
import time
from typing import Any

DEFAULT_PROMPTS = [
    "Let x = 42. What is x times seven? Think step by step before answering.",
    "A train leaves at noon at sixty miles per hour; another leaves an hour later at eighty. When does the second catch up?",
    "Prove that the sum of two even numbers is even.",
    "Hello! Count from one to ten and explain each step.",
]


def demo_prompts(n: int) -> list[str]:
    """n chat prompts: the defaults, then numbered variants of them."""
    return [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] + (f" (variant {i})" if i >= len(DEFAULT_PROMPTS) else "")
            for i in range(n)]


def run_demo(*, model: str | None = None, budget: int | None = 64, buffer: int = 16, policy: str = "random",
             batch_size: int = 4, response_length: int = 256, prompt_length: int = 128, temperature: float = 1.0,
             kv_cache_bytes: int = 64 << 20, num_cpus: int | None = None, echo=print) -> dict[str, Any]:
    import ray

    from kvtier.models.tiny import ensure_tiny_model

    from .local import LocalRollout, chat_batch, init_local_ray
    from ..metrics import eviction_metrics, per_sample_stats
    from ..verl_config import compose_config, cpu_rollout_overrides

    model = model or str(ensure_tiny_model())
    overrides = cpu_rollout_overrides(model, budget=budget, buffer=buffer, policy=policy, prompt_length=prompt_length,
                                      response_length=response_length, kv_cache_bytes=kv_cache_bytes,
                                      temperature=temperature, max_num_seqs=max(batch_size, 4))
    config = compose_config(overrides)
    prompts = demo_prompts(batch_size)
    t0 = time.perf_counter()
    started = init_local_ray(num_cpus=num_cpus)
    rollout = None
    try:
        rollout = LocalRollout(config)
        t_ready = time.perf_counter()
        batch = chat_batch(prompts)
        out = rollout.generate_sequences(batch)
        t_done = time.perf_counter()
        rows = per_sample_stats(out)
        lp = out.batch["rollout_log_probs"]
        mask = out.batch["response_mask"].bool()
        echo(f"kvtier rollout demo: rollout.name={config.actor_rollout_ref.rollout.name} policy={policy} "
             f"budget={budget} buffer={buffer} model={model}")
        echo(f"DataProto in: {len(batch)} prompts -> DataProto out: batch keys {sorted(out.batch.keys())}")
        header = f"{'#':>2} {'prompt':>6} {'resp':>5} {'budget':>6} {'events':>6} {'evicted/head':>12} {'peak blk':>8} " \
                 f"{'preempt':>7} {'mean logp':>9}"
        echo(header)
        for i, row in enumerate(rows):
            plen = int(out.batch["attention_mask"][i, : out.batch["prompts"].shape[1]].sum())
            mlp = float(lp[i][mask[i]].mean()) if mask[i].any() else float("nan")
            echo(f"{i:>2} {plen:>6} {row['response_tokens']:>5} {str(row['kvtier_budget']):>6} "
                 f"{str(row['kvtier_eviction_events']):>6} {str(row['kvtier_tokens_evicted']):>12} "
                 f"{str(row['kvtier_peak_kv_blocks']):>8} {str(row['kvtier_preemptions']):>7} {mlp:>9.3f}")
        metrics = eviction_metrics(out)
        echo(json.dumps({**metrics, "startup_s": round(t_ready - t0, 1), "generate_s": round(t_done - t_ready, 1)},
                        indent=2))
        return {"samples": rows, "metrics": metrics, "startup_s": t_ready - t0, "generate_s": t_done - t_ready}
    finally:
        if rollout is not None:
            rollout.close()
        if started:
            ray.shutdown()
