"""`kvtier bench goodput`: correct answers per second at a memory budget, through the service, against
stock vLLM.

Graded problems (the reasoner's held-out problems, both kinds in equal numbers or one alone, or a JSONL of
{"prompt", "answer"[, "kind", "id"]}) go through stock vLLM's OpenAI server and through `kvtier serve`:
one arm per tier (forced by the tier header), `full`, and `auto` (kvtier's routing). Every engine gets
the same model, KV bytes, max_model_len and max_num_seqs (servers.EngineSettings, sized as `bench serve`
sizes them). Decoding is greedy and stops at EOS or at `max_tokens` (no `ignore_eos`), so an arm that
writes longer or shorter traces pays or gains for it.

The driver is vLLM's own serving benchmark (`vllm.benchmarks.serve`): its `custom` dataset takes our
prompts in order (`--disable-shuffle`, `--skip-chat-template`) and `--save-detailed` returns every
request's generated text, output length, TTFT and latency in prompt order, which is all grading needs.

Per arm: accuracy per kind with the paired, problem-clustered bootstrap CI and sign test against `full`
(evaluation/stats.py), correct answers per second, output tok/s, mean and p99 output length and its ratio
to `full` on the same problems, TTFT and end-to-end latency (mean, p99), vLLM's preemption count,
applied eviction events, failed requests (with the end of their errors; a stream that carried an SSE error
event counts as failed: sse_reads.py) and the router's own 5xx count (router_errors); ratios to stock per
run. The top-level `arms` are the median run (by the main compressed arm's correct answers per second
relative to stock).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .environment import speed_probe_ms
from .serve import counters, kvtier_config, kvtier_stats, ttft_breakdown, vllm_client
from .servers import EngineSettings, ServerProcess, start_kvtier, start_stock, stop_servers_on_signals


@dataclass(frozen=True)
class GradedTask:
    pid: str
    kind: str
    prompt: str
    answer: str


def load_tasks(spec: str, per_kind: int, family: str = "chains", kinds: tuple[str, ...] | None = None) -> list[GradedTask]:
    """'reasoner': `per_kind` held-out problems of each of `kinds` (default: every kind) of the task family
    `family` (kvtier.tasks.chains; ValueError for an unknown family or kind), interleaved; else a JSONL path
    (first 2 * per_kind lines)."""
    if spec == "reasoner":
        from kvtier.tasks import chains

        fam = chains.family(family)
        kinds = [fam.eval_problems(per_kind, k) for k in (kinds or chains.KINDS)]
        return [GradedTask(f"{p.kind}-{i}", p.kind, p.prompt, p.answer)
                for i, group in enumerate(zip(*kinds)) for p in group]
    out = []
    for i, line in enumerate(Path(spec).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt" not in rec or "answer" not in rec:
            raise ValueError(f"{spec}:{i + 1}: a task line needs 'prompt' and 'answer'")
        out.append(GradedTask(str(rec.get("id", i)), str(rec.get("kind", "task")), rec["prompt"], str(rec["answer"])))
    if len({t.pid for t in out}) != len(out):
        raise ValueError(f"{spec}: duplicate ids")
    return out[: 2 * per_kind] if per_kind else out


def bench_args(settings: EngineSettings, server: ServerProcess, dataset: Path, n: int, concurrency: int,
               max_tokens: int, headers: dict[str, str], seed: int) -> argparse.Namespace:
    """vLLM's serving benchmark on our prompts, in order, greedy, stopping at EOS, detailed results."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
            "--model", settings.model_id, "--tokenizer", settings.model_path,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
            "--skip-chat-template", "--custom-output-len", str(max_tokens), "--num-prompts", str(n),
            "--max-concurrency", str(concurrency), "--temperature", "0", "--seed", str(seed),
            "--num-warmups", "0", "--disable-tqdm", "--save-detailed",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99"]
    if headers:
        argv += ["--header", *(f"{k}={v}" for k, v in headers.items())]
    return parser.parse_args(argv)


def run_arm(arm: str, server: ServerProcess, settings: EngineSettings, tasks: list[GradedTask], dataset: Path,
            concurrency: int, max_tokens: int, seed: int, client_nice: int | None = None) -> dict:
    """One benchmark of `arm` on `server`: graded per problem, plus the run's counters."""
    from vllm.benchmarks.serve import main as vllm_bench

    from kvtier.evaluation.grader import grade

    headers = {} if arm in ("stock", "auto") else {"x-kvtier-tier": arm}
    kind = "stock" if arm == "stock" else "kvtier"
    before, router0 = counters(kind, server), router_counts(kind, server)
    probe0 = speed_probe_ms()
    since = time.time()
    with vllm_client(client_nice) as watch:
        r = vllm_bench(bench_args(settings, server, dataset, len(tasks), concurrency, max_tokens, headers, seed))
    probe1 = speed_probe_ms()
    after, router1 = counters(kind, server), router_counts(kind, server)
    # where a kvtier arm's time to first token went: the router's segments (first_token.py)
    breakdown = {} if kind == "stock" else ttft_breakdown(server, since, float(r["mean_ttft_ms"]))
    errors = list(r.get("errors") or [""] * len(tasks))
    per = []
    for t, text, n_out, err in zip(tasks, r["generated_texts"], r["output_lens"], errors):
        ok = not err
        per.append({"pid": t.pid, "kind": t.kind, "correct": bool(ok and grade(text or "", t.answer).correct),
                    "output_tokens": int(n_out), "failed": not ok, **({"error": str(err).strip()[-500:]} if err else {})})
    return {**breakdown, "client_stalls": watch.summary(), "arm": arm, "duration_s": float(r["duration"]),
            "per_problem": per,
            "ttft_ms": float(r["mean_ttft_ms"]), "ttft_p50_ms": float(r["median_ttft_ms"]),
            "ttft_p99_ms": float(r["p99_ttft_ms"]),
            "e2el_ms": float(r["mean_e2el_ms"]), "e2el_p99_ms": float(r["p99_e2el_ms"]),
            "tok_per_s": float(r["output_throughput"]), "failed": int(r["failed"]),
            "preemptions": None if after[0] is None else after[0] - (before[0] or 0.0),
            "eviction_events": None if after[1] is None else after[1] - (before[1] or 0.0),
            **counts_since(router0, router1),
            "speed_probe_ms": [probe0, probe1]}   # the machine's speed just before and after (environment.py)


def router_counts(kind: str, server: ServerProcess) -> dict | None:
    """A kvtier server's counters so far (None for stock): elastic requests tightened over its engines'
    tiers, requests answered by the budget they ended with, and the 5xx the router counted, by status and
    reason (refused, or an engine lost mid-stream)."""
    if kind == "stock":
        return None
    stats = kvtier_stats(server)
    ends: dict[str, int] = {}
    for row in stats["router"].get("final_budgets", []):
        ends[row["budget"]] = ends.get(row["budget"], 0) + row["count"]
    errors: dict[str, int] = {}
    for row in stats["router"].get("rejections", []):
        if row["status"] >= 500:
            key = f"{row['status']} {row['reason']}"
            errors[key] = errors.get(key, 0) + row["count"]
    tightenings = float(sum(sum(((e.get("eviction") or {}).get("tightenings") or {}).values())
                            for e in stats["engines"].values()))
    return {"tightenings": tightenings, "final_budgets": ends, "router_errors": errors}


def counts_since(before: dict | None, after: dict | None) -> dict:
    """An arm's share of router_counts: what changed between before and after (None for stock)."""
    if after is None:
        return {"tightenings": None, "final_budgets": None, "router_errors": None}

    def grown(key):   # the counts by label that rose during the arm
        return {k: n - before[key].get(k, 0) for k, n in sorted(after[key].items()) if n > before[key].get(k, 0)}
    return {"tightenings": after["tightenings"] - before["tightenings"], "final_budgets": grown("final_budgets"),
            "router_errors": grown("router_errors")}


def _scores(per: list[dict], kind: str) -> dict:
    return {p["pid"]: [1.0 if p["correct"] else 0.0] for p in per if p["kind"] == kind}


def summarize_arm(raw: dict, full: dict | None) -> dict:
    """The JSON of one arm in one run: accuracy per kind (+ CI vs full), goodput, lengths, latency."""
    from kvtier.evaluation.reasoner_eval import accuracy_ci
    from kvtier.evaluation.stats import compare

    per = raw["per_problem"]
    kinds = sorted({p["kind"] for p in per})
    acc = {k: float(np.mean([p["correct"] for p in per if p["kind"] == k])) for k in kinds}
    ci = {}
    for k in kinds:
        rows = [p for p in per if p["kind"] == k]
        ci[k] = {"accuracy": [round(x, 4) for x in accuracy_ci(rows)]}
        if full is not None and raw["arm"] != "full":
            c = compare(_scores(per, k), _scores(full["per_problem"], k), name_a=raw["arm"], name_b="full")
            ci[k]["vs_full"] = {"diff": c.diff, "lo": c.lo, "hi": c.hi, "p_sign": c.p_sign,
                                "significant": c.significant}
    lengths = [p["output_tokens"] for p in per]
    out = {"accuracy": acc, "ci": ci, "correct": int(sum(p["correct"] for p in per)), "problems": len(per),
           "correct_per_s": round(sum(p["correct"] for p in per) / raw["duration_s"], 4),
           "tok_per_s": round(raw["tok_per_s"], 1), "seconds": round(raw["duration_s"], 1),
           "mean_output_tokens": round(float(np.mean(lengths)), 1),
           "p99_output_tokens": float(np.percentile(lengths, 99)),
           "ttft_ms": round(raw["ttft_ms"], 1), "ttft_p50_ms": round(raw["ttft_p50_ms"], 1),
           "ttft_p99_ms": round(raw["ttft_p99_ms"], 1),
           "e2el_ms": round(raw["e2el_ms"], 1), "e2el_p99_ms": round(raw["e2el_p99_ms"], 1),
           "preemptions": raw["preemptions"], "eviction_events": raw["eviction_events"],
           "tightenings": raw.get("tightenings"), "final_budgets": raw.get("final_budgets"), "failed": raw["failed"],
           "router_errors": raw.get("router_errors"),
           "speed_probe_ms": raw.get("speed_probe_ms"),
           **{k: raw[k] for k in ("ttft_breakdown_ms", "client_stalls") if raw.get(k)},
           # why requests failed (each distinct error once): a failed arm is diagnosable from its JSON
           **({"errors": sorted({p["error"] for p in per if p.get("error")})} if raw["failed"] else {})}
    if full is not None:
        theirs = {p["pid"]: p["output_tokens"] for p in full["per_problem"]}
        shared = [p for p in per if p["pid"] in theirs]
        out["length_ratio_to_full"] = round(float(np.mean([p["output_tokens"] for p in shared]))
                                            / max(float(np.mean([theirs[p["pid"]] for p in shared])), 1e-9), 4)
    return out


def one_run(arms: list[str], settings: EngineSettings, config: dict, tasks: list[GradedTask], workdir: Path,
            concurrency: int, max_tokens: int, seed: int, log, client_nice: int | None = None) -> dict:
    """Every arm once: stock on its own server, every kvtier arm on one `kvtier serve`."""
    dataset = workdir / "goodput-prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t.prompt}) + "\n" for t in tasks))
    raw: dict[str, dict] = {}
    groups = [("stock", [a for a in arms if a == "stock"]), ("kvtier", [a for a in arms if a != "stock"])]
    for kind, served in groups:
        if not served:
            continue
        server = start_stock(settings, workdir) if kind == "stock" else \
            start_kvtier("kvtier-goodput", kvtier_config(config, settings), workdir)
        try:
            log(f"{kind}: ready after {server.wait_ready(settings.model_id, prompt=tasks[0].prompt):.0f} s")
            for arm in served:
                raw[arm] = run_arm(arm, server, settings, tasks, dataset, concurrency, max_tokens, seed, client_nice)
                ok = sum(p["correct"] for p in raw[arm]["per_problem"])
                log(f"{arm:>8}: {ok}/{len(tasks)} correct in {raw[arm]['duration_s']:.0f} s "
                    f"({ok / raw[arm]['duration_s']:.3f}/s), {raw[arm]['tok_per_s']:.0f} tok/s, "
                    f"preemptions {raw[arm]['preemptions']}, eviction events {raw[arm]['eviction_events']}")
        finally:
            server.stop()
    full = raw.get("full")
    out = {arm: summarize_arm(r, full) for arm, r in raw.items()}
    stock = out.get("stock")
    for res in out.values():
        if stock:
            res["correct_per_s_ratio_to_stock"] = round(res["correct_per_s"] / max(stock["correct_per_s"], 1e-9), 3)
            res["tok_per_s_ratio_to_stock"] = round(res["tok_per_s"] / stock["tok_per_s"], 3)
            res["ttft_ratio_to_stock"] = round(res["ttft_ms"] / stock["ttft_ms"], 3)
    return out


def main_arm(arms: list[str]) -> str | None:
    """The arm the median run is chosen by: auto (the default compressed tier), else the first tier arm."""
    return "auto" if "auto" in arms else next((a for a in arms if a not in ("stock", "full")), None)


def median_of(per_run: list[dict], arms: list[str]) -> dict:
    """The runs' summary: the median run's arms (ranked by main_arm's ratio to stock), and every run's."""
    key = main_arm(arms)
    score = (lambda r: r[key].get("correct_per_s_ratio_to_stock", r[key]["correct_per_s"])) if key else (lambda r: 0)
    ranked = sorted(range(len(per_run)), key=lambda i: score(per_run[i]))
    median = ranked[(len(per_run) - 1) // 2]
    return {"arms": per_run[median], "median_run": median, "median_by": key, "runs": per_run,
            "summary": {arm: {"correct_per_s_ratio_to_stock": [r[arm].get("correct_per_s_ratio_to_stock")
                                                               for r in per_run]} for arm in arms}}


def run_goodput(settings: EngineSettings, config: dict, tasks: list[GradedTask], arms: list[str], runs: int,
                workdir: Path, concurrency: int, max_tokens: int, seed: int = 0, log=print,
                family: str | None = None, client_nice: int | None = None) -> dict:
    """Every arm `runs` times; `family`: the task family the reasoner's problems came from (recorded);
    `client_nice`: the benchmark client's priority while it measures (client_clock.py; recorded)."""
    from .environment import machine_and_commit

    where = machine_and_commit()          # at the start: the code that runs, not what is checked out at the end
    workdir.mkdir(parents=True, exist_ok=True)
    per_run = []
    with stop_servers_on_signals():
        for i in range(runs):
            log(f"run {i + 1}/{runs}")
            per_run.append(one_run(arms, settings, config, tasks, workdir, concurrency, max_tokens, seed, log,
                                   client_nice))
    tasks_run = {"problems": len(tasks), "kinds": sorted({t.kind for t in tasks}), **({"family": family} if family else {})}
    return {**median_of(per_run, arms), "settings": {**asdict(settings), "client_nice": client_nice}, "tasks": tasks_run,
            "concurrency": concurrency, "max_tokens": max_tokens,
            "routing_rule": config.get("routing", {}).get("rule"), **where}


def plot(result: dict, path: Path) -> None:
    """Accuracy against correct answers per second, one point per arm (the median run); per-kind
    accuracies as hollow markers at the same x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = ["s", "^", "v", "D", "P"]
    kinds = sorted({k for a in result["arms"].values() for k in a["accuracy"]})
    for arm, a in result["arms"].items():
        x = a["correct_per_s"]
        y = a["correct"] / max(a["problems"], 1)
        label = arm + (f": {a['correct_per_s_ratio_to_stock']:.2f}x stock" if "correct_per_s_ratio_to_stock" in a else "")
        ax.scatter([x], [y], s=60, zorder=3, label=label)
        for k, m in zip(kinds, markers):
            if k in a["accuracy"]:
                ax.scatter([x], [a["accuracy"][k]], marker=m, facecolors="none", edgecolors="gray", s=30, zorder=2,
                           label=k if arm == next(iter(result["arms"])) else None)
    ax.set_xlabel("correct answers per second (median run)")
    ax.set_ylabel("accuracy (filled: all problems; hollow: per kind)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlim(0, 1.35 * max(a["correct_per_s"] for a in result["arms"].values()))
    ax.legend(fontsize=8, loc="center right")
    s = result["settings"]
    ax.set_title(f"kvtier bench goodput: {result['tasks']['problems']} problems, concurrency {result['concurrency']}, "
                 f"KV {s['kv_cache_bytes'] >> 20} MiB, {len(result['runs'])} runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
