"""`kvtier bench throughput`: offered load of N requests x (P prompt + G generated) tokens, one engine and
one KV pool, full attention vs compressed policies. Greedy with ignore_eos so G tokens are really
generated (vLLM's own benchmark silently ignored the output length in the paper's runs).

Arms: `full` (no eviction on the patched engine), any policy name (budget --budget), `policy:K` for another
budget, and `stock` (unpatched vLLM, kvtier plugin not loaded, in a subprocess with the same settings).
A compressed arm with zero applied eviction events is marked invalid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from .harness import TINY_BLOCK_BYTES, StepObserver, build_bench_engine, prompts_of, run_load


@dataclass(frozen=True)
class LoadShape:
    requests: int = 16
    prompt_tokens: int = 128
    gen_tokens: int = 2048
    budget: int = 256
    buffer: int = 64
    kv_bytes: int = 69 * TINY_BLOCK_BYTES   # 68 usable blocks: 4 full-length sequences of the default shape
    max_num_seqs: int = 256


def parse_arm(arm: str, default_budget: int) -> tuple[str, int | None]:
    if arm in ("full", "stock"):
        return arm, None
    name, _, k = arm.partition(":")
    return name, int(k) if k else default_budget


def _stock_arm(model: str, s: LoadShape) -> dict:
    """Unpatched vLLM in a fresh process (VLLM_PLUGINS=none keeps kvtier's plugin out)."""
    code = (
        "import json,sys,time\n"
        "from vllm import LLM, SamplingParams\n"
        "from kvtier.benchmarks.harness import prompts_of\n"
        f"llm=LLM(model={model!r}, kv_cache_memory_bytes={s.kv_bytes}, max_model_len={s.prompt_tokens + s.gen_tokens + 8},"
        f" max_num_seqs={s.max_num_seqs}, enforce_eager=True, dtype='bfloat16', enable_prefix_caching=False,"
        " disable_log_stats=True)\n"
        "llm.generate([{'prompt_token_ids': list(range(10, 26))}], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        f"p=prompts_of({s.requests}, {s.prompt_tokens})\n"
        f"sp=SamplingParams(max_tokens={s.gen_tokens}, temperature=0, ignore_eos=True)\n"
        "t=time.perf_counter(); out=llm.generate(p, sp, use_tqdm=False); dt=time.perf_counter()-t\n"
        "print('RESULT'+json.dumps({'seconds': dt, 'tokens': sum(len(o.outputs[0].token_ids) for o in out)}))\n")
    env = {**os.environ, "VLLM_PLUGINS": "none", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"stock arm failed:\n{proc.stderr[-3000:]}")
    r = json.loads(line[6:])
    return {"tok_per_s": r["tokens"] / r["seconds"], "seconds": r["seconds"], "generated_tokens": r["tokens"],
            "peak_running": None, "preemptions": None, "eviction_events": 0, "valid": True}


def run_throughput_bench(model: str, s: LoadShape, arms: list[str], plot: str | None = None,
                         policy_params: dict[str, dict] | None = None) -> dict:
    """policy_params: per policy name, its kvtier_params (e.g. {"triattention": {"calibration": PATH}})."""
    from vllm import SamplingParams

    from kvtier.engine.api import eviction_stats, pool_state, sampling_extra_args

    llm = build_bench_engine(model, s.kv_bytes, s.prompt_tokens + s.gen_tokens + 8, s.max_num_seqs, s.buffer)
    obs = StepObserver().attach(llm)
    pool = pool_state(llm)
    prompts = prompts_of(s.requests, s.prompt_tokens)
    results: dict[str, dict] = {}
    for arm in arms:
        name, budget = parse_arm(arm, s.budget)
        if name == "stock":
            results[arm] = _stock_arm(model, s)
            continue
        extra = (sampling_extra_args(budget=budget, policy=name, buffer=s.buffer,
                                     params=(policy_params or {}).get(name) or None)
                 if budget is not None else None)
        params = SamplingParams(max_tokens=s.gen_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        before = eviction_stats(llm)["engine"]
        obs.reset()
        seconds, outs = run_load(llm, prompts, params)
        after = eviction_stats(llm)["engine"]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        events = after["events"] - before["events"]
        rounds_ms = after["round_ms_sum"] - before["round_ms_sum"]
        eviction_steps = after["steps_with_eviction"] - before["steps_with_eviction"]
        results[arm] = {
            "tok_per_s": tokens / seconds, "seconds": seconds, "generated_tokens": tokens,
            "peak_running": obs.peak_running, "preemptions": obs.preemptions,
            "eviction_events": events, "tokens_evicted": after["tokens_evicted"] - before["tokens_evicted"],
            "blocks_freed": after["blocks_freed"] - before["blocks_freed"],
            "eviction_ms_total": rounds_ms,
            # per-step eviction overhead: the worker's compaction time per engine step that ran rounds, and
            # its share of the arm's wall time
            "eviction_steps": eviction_steps,
            "eviction_ms_per_step": rounds_ms / eviction_steps if eviction_steps else 0.0,
            "eviction_share_of_wall": rounds_ms / 1e3 / seconds,
            "valid": budget is None or events > 0,
        }
        assert pool_state(llm)["free_blocks"] == pool["free_blocks"], "KV blocks leaked"
    base = results.get("full") or results.get("stock")
    for r in results.values():
        r["ratio_to_full"] = r["tok_per_s"] / base["tok_per_s"] if base else None
    if "stock" in results and "full" in results:
        results["full"]["ratio_to_stock"] = results["full"]["tok_per_s"] / results["stock"]["tok_per_s"]
    report = {"model": model, "shape": asdict(s), "pool": pool, "arms": results, "policy_params": policy_params or {},
              "valid": all(r["valid"] for r in results.values())}
    if plot:
        _plot(report, plot)
        report["plot"] = plot
    return report


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(report["arms"])
    tps = [report["arms"][a]["tok_per_s"] for a in arms]
    fig, ax = plt.subplots(figsize=(1.6 * len(arms) + 2, 3.6))
    bars = ax.bar(arms, tps, color=["#888" if a in ("full", "stock") else "#2a7" for a in arms])
    for b, a in zip(bars, arms):
        r = report["arms"][a]
        label = f"{r['ratio_to_full']:.2f}x" if r.get("ratio_to_full") else ""
        if r.get("preemptions") is not None:
            label += f"\n{r['preemptions']} preempt"
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    s = report["shape"]
    ax.set_ylabel("generated tok/s")
    ax.set_title(f"{s['requests']} req x ({s['prompt_tokens']}+{s['gen_tokens']}) tok, K={s['budget']}, "
                 f"pool {report['pool']['total_blocks']} blocks", fontsize=9)
    ax.set_ylim(0, max(tps) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
