"""`kvtier bench prefix-cache`: a shared-prefix workload (P prompts x n samples each, GRPO's shape) on one KV
pool, stock vLLM with prefix caching against kvtier at full attention and at a budget K, each with and
without prefix caching, greedy with ignore_eos (every sample writes G tokens).

Each arm runs in a fresh process (VLLM_PLUGINS=none for stock), in-process engine core, so the scheduler's
steps can be counted: prompt tokens computed = every token the scheduler scheduled minus the decode steps
(G - 1 per sample), which counts the recompute of preempted samples too; vLLM's own prefix-cache counters
(first admissions) give the hit rate. Budgets: random protects the whole prompt, so K counts the prompt
(K = prompt + 256 keeps 256 trace entries besides it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from .harness import TINY_BLOCK_BYTES, StepObserver, prompts_of, run_load


@dataclass(frozen=True)
class SharedPrefixShape:
    prompts: int = 16
    samples: int = 8
    prompt_tokens: int = 1024
    gen_tokens: int = 1024
    budget: int = 1280                       # K: the 1024-token prompt plus 256 trace entries
    buffer: int = 64
    kv_bytes: int = 65 * TINY_BLOCK_BYTES    # 64 usable blocks: 4 full-length sequences (2048 tokens each)
    max_num_seqs: int = 256


# arm -> (kvtier plugin loaded, budget or None, prefix caching)
ARMS = {"stock+pc": (False, None, True), "full": (True, None, False), "full+pc": (True, None, True),
        "k": (True, "budget", False), "k+pc": (True, "budget", True)}


def run_arm(arm: str, model: str, s: SharedPrefixShape) -> dict:
    """One arm in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 and, for stock, VLLM_PLUGINS=none)."""
    from vllm import LLM, SamplingParams

    from kvtier.engine.api import engine_kwargs, pool_state, sampling_extra_args, warm_up

    kvtier, budget_key, prefix_caching = ARMS[arm]
    kw = dict(max_model_len=s.prompt_tokens + s.gen_tokens + 8, max_num_seqs=s.max_num_seqs, enforce_eager=True,
              dtype="bfloat16", enable_prefix_caching=prefix_caching, disable_log_stats=False)
    if kvtier:
        from kvtier.engine.plugin import register

        register()
        llm = LLM(model=model, **engine_kwargs(eviction={"default": {"buffer": s.buffer}}, kv_cache_bytes=s.kv_bytes, **kw))
    else:
        llm = LLM(model=model, kv_cache_memory_bytes=s.kv_bytes, **kw)
    warm_up(llm)
    extra = sampling_extra_args(budget=s.budget if budget_key else "full") if kvtier else None
    params = SamplingParams(max_tokens=s.gen_tokens, temperature=0, ignore_eos=True, extra_args=extra)
    prompts = [p for p in prompts_of(s.prompts, s.prompt_tokens, seed=1) for _ in range(s.samples)]
    before = _counters(llm)
    obs = StepObserver().attach(llm)
    seconds, outs = run_load(llm, prompts, params)
    after = _counters(llm)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    queries, hits = (after[k] - before[k] for k in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))
    out = {"tok_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
           "prompt_tokens_computed": obs.scheduled_tokens - (generated - len(outs)),
           "prompt_tokens_offered": len(prompts) * s.prompt_tokens,
           "prefix_cache_queries": queries, "prefix_cache_hits": hits,
           "hit_rate": hits / queries if queries else 0.0,
           "preemptions": obs.preemptions, "peak_running": obs.peak_running,
           "eviction_events": None, "free_blocks_after": pool_state(llm)["free_blocks"]}
    if kvtier:
        from kvtier.engine.api import eviction_stats

        out["eviction_events"] = eviction_stats(llm)["engine"]["events"]
    return out


def _counters(llm) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics() if hasattr(m, "value")}


def run_prefix_cache_bench(model: str, s: SharedPrefixShape, arms: list[str], plot: str | None = None) -> dict:
    """Every arm in its own process; ratios and the issue's targets on the arms present."""
    results = {}
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; choose from {sorted(ARMS)}")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not ARMS[arm][0]:
            env["VLLM_PLUGINS"] = "none"
        proc = subprocess.run([sys.executable, "-m", "kvtier.benchmarks.prefix_cache", arm, model, json.dumps(asdict(s))],
                              env=env, capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            raise RuntimeError(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
        results[arm] = json.loads(line[len("RESULT"):])
    report = {"model": model, "shape": asdict(s), "arms": results, **_ratios(results)}
    if plot:
        _plot(report, plot)
        report["plot"] = plot
    return report


def _ratios(r: dict) -> dict:
    def ratio(a, b, key="tok_per_s"):
        return r[a][key] / r[b][key] if a in r and b in r and r[b][key] else None

    computed = {k: ratio(f"{k}+pc", k, "prompt_tokens_computed") for k in ("full", "k")}
    saved = {k: 1 - v for k, v in computed.items() if v is not None}
    ratios = {"prompt_tokens_saved": saved, "k+pc_over_stock+pc": ratio("k+pc", "stock+pc"),
              "full+pc_over_stock+pc": ratio("full+pc", "stock+pc")}
    targets = {"prompt_tokens_saved_ge_0.85": all(v >= 0.85 for v in saved.values()) if saved else None,
               "k+pc_ge_2x_stock+pc": None if ratios["k+pc_over_stock+pc"] is None else ratios["k+pc_over_stock+pc"] >= 2.0,
               "full+pc_ge_0.97x_stock+pc": None if ratios["full+pc_over_stock+pc"] is None
               else ratios["full+pc_over_stock+pc"] >= 0.97}
    return {"ratios": ratios, "targets": targets}


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(report["arms"])
    r = report["arms"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(2.2 * len(arms) + 3, 3.8))
    colours = ["#888" if a.startswith(("stock", "full")) else "#2a7" for a in arms]
    bars = a1.bar(arms, [r[a]["tok_per_s"] for a in arms], color=colours)
    for b, a in zip(bars, arms):
        a1.annotate(f"{r[a]['preemptions']} preempt", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    a1.set_ylabel("generated tok/s")
    a2.bar(arms, [r[a]["prompt_tokens_computed"] / 1e3 for a in arms], color=colours)
    a2.set_ylabel("prompt tokens computed (thousands)")
    s = report["shape"]
    fig.suptitle(f"{s['prompts']} prompts x n={s['samples']}, ({s['prompt_tokens']}+{s['gen_tokens']}) tok, "
                 f"K={s['budget']}, pool {s['kv_bytes'] // TINY_BLOCK_BYTES - 1} blocks", fontsize=9)
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":   # one arm, in the process run_prefix_cache_bench started
    arm_name, model_dir, shape = sys.argv[1], sys.argv[2], SharedPrefixShape(**json.loads(sys.argv[3]))
    print("RESULT" + json.dumps(run_arm(arm_name, model_dir, shape)), flush=True)
