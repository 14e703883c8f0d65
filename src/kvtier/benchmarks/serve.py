"""`kvtier bench serve`: kvtier side by side with what users run today, driven by vLLM's own serving
benchmark (`vllm.benchmarks.serve`, its Python entry: `add_cli_args` + `main`).

Arms (servers.py; every engine gets the same model, KV bytes, max_model_len and max_num_seqs):
  stock   vLLM's OpenAI server            rayllm  Ray Serve LLM's `build_openai_app`
  full    kvtier serve, tier forced to `full` (the tier header)
  auto    kvtier serve, kvtier's routing (no header)
`full` and `auto` are two benchmarks against one kvtier server. Workloads: `idle` (one request at a time),
`short` (fits the pool) and `long` (KV-bound long generation). For kvtier's arms, where the time to first
token goes (the router's segments, service/first_token.py, and the rest: Serve's proxy and HTTP). Per arm: output tok/s, TTFT and TPOT (mean, p99), preemptions (vLLM's own
count), failed requests, CPU seconds per 1,000 generated tokens outside the engine core (the cost of the
serving path) and each arm's ratio to `stock` in the same run. `--runs N` repeats everything (the machine
is noisy); ratios are per run, targets are checked per run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from .client_clock import StallWatch, client_priority, streams_read_in_one_burst
from .servers import (EngineSettings, ServerProcess, prometheus_sum, start_kvtier, start_rayllm, start_stock,
                      stop_servers_on_signals)
from .sse_reads import whole_events

ARMS = ("stock", "rayllm", "full", "auto")
# the processes a request's tokens pass through besides the engine core (servers.process_group); Ray's own
# daemons (raylet, GCS, agents) are reported in cpu_s but not counted: they run whether or not tokens flow
SERVING_PATH = ("proxy", "router", "engine_frontend")


@dataclass(frozen=True)
class Workload:
    prompts: int
    input_len: int
    output_len: int
    concurrency: int


def bench_args(settings: EngineSettings, server: ServerProcess, w: Workload, headers: dict[str, str],
               seed: int) -> argparse.Namespace:
    """vLLM's serving benchmark, as `vllm bench serve` would be called on the command line."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
            "--model", settings.model_id, "--tokenizer", settings.model_path,
            "--dataset-name", "random", "--random-input-len", str(w.input_len),
            "--random-output-len", str(w.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(w.prompts), "--max-concurrency", str(w.concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--num-warmups", "2", "--disable-tqdm",
            "--save-detailed",   # per-request TTFTs come back (the p99 of a small run is its worst request)
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99"]
    if headers:
        argv += ["--header", *(f"{k}={v}" for k, v in headers.items())]
    return parser.parse_args(argv)


def counters(arm: str, server: ServerProcess) -> tuple[float | None, float | None]:
    """(preemptions, eviction events) so far: vLLM's own preemption count (stock: its /metrics; rayllm:
    Ray's metrics export, which lags up to 10 s; any other arm is a kvtier server: its engines' load) and
    kvtier's applied eviction events (None where there is no kvtier engine)."""
    if arm == "stock":
        return prometheus_sum(server.url + "/metrics", "vllm:num_preemptions_total"), None
    if arm == "rayllm":
        time.sleep(12)
        return prometheus_sum(server.metrics_url, "ray_vllm_num_preemptions_total"), None
    engines = kvtier_stats(server)["engines"]
    return (float(sum(e.get("preemptions", 0) for e in engines.values())),
            float(sum((e.get("eviction") or {}).get("events", 0) for e in engines.values())))


def kvtier_stats(server: ServerProcess, attempts: int = 5, wait_s: float = 2.0) -> dict:
    """A kvtier server's /v1/kvtier/stats?eviction=true in which every engine answered this time: its load
    poll and its eviction counters. An engine that did not answer keeps its last polled numbers there,
    which would make a counter's difference 0 without a word, so the call is retried and then refused."""
    why = ""
    for _ in range(attempts):
        stats = httpx.get(server.url + "/v1/kvtier/stats", params={"eviction": "true"}, timeout=30).json()
        failed = {name: e.get("error") or (e.get("eviction") or {}).get("error") for name, e in stats["engines"].items()}
        failed = {name: err for name, err in failed.items() if err}
        if not failed:
            return stats
        why = "; ".join(f"{name}: {err}" for name, err in failed.items())
        time.sleep(wait_s)
    raise RuntimeError(f"kvtier stats: engines did not answer {attempts} times, so their counters are unknown ({why})")


def ttft_breakdown(server: ServerProcess, since: float, mean_ttft_ms: float) -> dict:
    """A kvtier arm's first-token breakdown: the router's segments (mean, p99) over the requests since
    `since` (the benchmark's warm-ups included), and `proxy_and_http_ms`, the client's mean TTFT minus the
    router's (Serve's proxy both ways, HTTP, the client)."""
    stats = httpx.get(server.url + "/v1/kvtier/stats", params={"ttft_since": since}, timeout=30).json()
    router = stats.get("ttft_breakdown", {}).get("all", {})
    total = router.get("total", {}).get("mean_ms")
    return {"ttft_breakdown_ms": {**router, "proxy_and_http": {"mean_ms": round(mean_ttft_ms - total, 2)}}
            if total is not None else {}}


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None else after - (before or 0.0)


@contextlib.contextmanager
def vllm_client(client_nice: int | None):
    """Around one call of vLLM's serving benchmark (bench serve and bench goodput alike): its report table
    goes nowhere (the numbers come back as a dict), the client runs at `client_nice` (client_clock.py), its
    own stalls are watched (yields the StallWatch: a uniform wait for every first token is the load
    generator not running, not the server), and it reads whole SSE events (sse_reads.py)."""
    with contextlib.redirect_stdout(io.StringIO()), client_priority(client_nice), StallWatch() as watch, \
            whole_events():
        yield watch


def run_one(arm: str, server: ServerProcess, settings: EngineSettings, w: Workload, seed: int,
            client_nice: int | None = None) -> dict:
    from vllm.benchmarks.serve import main as vllm_bench

    headers = {"x-kvtier-tier": "full"} if arm == "full" else {}
    since = time.time()
    before = counters(arm, server)
    before_cpu = server.cpu_seconds()   # CPU is sampled right around the benchmark, not the metric reads
    with vllm_client(client_nice) as watch:
        r = vllm_bench(bench_args(settings, server, w, headers, seed))
    after_cpu = server.cpu_seconds()
    after = counters(arm, server)
    cpu = {g: round(after_cpu.get(g, 0.0) - before_cpu.get(g, 0.0), 2) for g in after_cpu}
    tokens = max(int(r["total_output_tokens"]), 1)
    serving_cpu = sum(cpu.get(g, 0.0) for g in SERVING_PATH)
    extra = {} if arm in ("stock", "rayllm") else ttft_breakdown(server, since, r["mean_ttft_ms"])
    return {**extra,
        "tok_per_s": round(r["output_throughput"], 1), "ttft_ms": round(r["mean_ttft_ms"], 1),
        "ttft_p99_ms": round(r["p99_ttft_ms"], 1), "tpot_ms": round(r["mean_tpot_ms"], 2),
        "tpot_p99_ms": round(r["p99_tpot_ms"], 2), "completed": r["completed"], "failed": r["failed"],
        "output_tokens": r["total_output_tokens"], "seconds": round(r["duration"], 1),
        "preemptions": _delta(after[0], before[0]), "eviction_events": _delta(after[1], before[1]),
        "ttfts_ms": [round(1000 * t, 1) for t in r.get("ttfts", [])],   # in the order the requests were sent
        "cpu_s": cpu, "serving_cpu_s_per_1k_tokens": round(1000 * serving_cpu / tokens, 3),
        "engine_core_cpu_s_per_1k_tokens": round(1000 * cpu.get("engine_core", 0.0) / tokens, 3),
        "client_stalls": watch.summary(),   # the benchmark client's own (client_clock.py), not the server's
        "streams_read_in_one_burst": streams_read_in_one_burst(r.get("ttfts", []), r.get("itls", [])),
    }


def measured_run(arm: str, server: ServerProcess, settings: EngineSettings, w: Workload, seed: int,
                 client_nice: int | None, log) -> dict:
    """run_one, measured once more if every stream reached the client in one read (its TPOT would be ~0, no
    measurement); the discarded run is kept under `discarded_run`."""
    res = run_one(arm, server, settings, w, seed, client_nice)
    if not (res["completed"] and res["streams_read_in_one_burst"] == res["completed"]):
        return res
    log(f"{arm}: every stream reached the client in one read (client stalls {res['client_stalls']}): "
        "its TPOT is no measurement; measuring the arm again")
    discarded = {k: v for k, v in res.items() if k != "ttfts_ms"}
    return {**run_one(arm, server, settings, w, seed, client_nice), "discarded_run": discarded}


def kvtier_config(base: dict, settings: EngineSettings) -> dict:
    """The service config the kvtier arms run: `base` (src/kvtier/configs/local.yaml) with the shared engine
    settings."""
    cfg = json.loads(json.dumps(base))
    (name, eng), = cfg["engines"].items()
    eng.update(kv_cache_bytes=settings.kv_cache_bytes, max_model_len=settings.max_model_len, model_id=settings.model_id,
               enable_prefix_caching=settings.prefix_caching)
    eng.setdefault("engine_kwargs", {}).update(max_num_seqs=settings.max_num_seqs, enforce_eager=True,
                                              dtype=settings.dtype)
    cfg.setdefault("server", {}).pop("port", None)
    return cfg


def one_run(arms: list[str], settings: EngineSettings, config: dict, workloads: dict[str, Workload],
            workdir: Path, seed: int, log, client_nice: int | None = None) -> dict:
    results: dict[str, dict] = {name: {} for name in workloads}
    servers = [("stock", ["stock"]), ("rayllm", ["rayllm"]), ("kvtier", [a for a in ("full", "auto")])]
    for kind, served in servers:
        served = [a for a in served if a in arms]
        if not served:
            continue
        server = (start_stock(settings, workdir) if kind == "stock" else start_rayllm(settings, workdir)
                  if kind == "rayllm" else start_kvtier("kvtier", kvtier_config(config, settings), workdir))
        try:
            log(f"{kind}: ready after {server.wait_ready(settings.model_id):.0f} s")
            for wname, w in workloads.items():
                for arm in served:
                    results[wname][arm] = res = measured_run(arm, server, settings, w, seed, client_nice, log)
                    log(f"{wname:>5} {arm:>6}: {res['tok_per_s']:8.1f} tok/s  TTFT {res['ttft_ms']:7.1f} ms  "
                        f"TPOT {res['tpot_ms']:6.2f} ms  "
                        f"preemptions {res['preemptions']}  failed {res['failed']}  "
                        f"serving CPU {res['serving_cpu_s_per_1k_tokens']} s/1k tok  "
                        f"client stalls {res['client_stalls']['stalls']} (max {res['client_stalls']['max_ms']} ms)")
        finally:
            server.stop()
    for arms_of in results.values():
        stock = arms_of.get("stock")
        for res in arms_of.values():
            if stock:
                for name, key in (("ratio_to_stock", "tok_per_s"), ("tpot_ratio_to_stock", "tpot_ms"),
                                  ("ttft_ratio_to_stock", "ttft_ms")):   # None where stock's is 0: no measurement
                    res[name] = round(res[key] / stock[key], 3) if stock[key] else None
                res["ttft_minus_stock_ms"] = round(res["ttft_ms"] - stock["ttft_ms"], 1)
                res["ttft_p99_minus_stock_ms"] = round(res["ttft_p99_ms"] - stock["ttft_p99_ms"], 1)
    return results


def targets(run: dict) -> dict:
    """The targets, for one run (per workload present):
    idle  (#27) `full`: mean TTFT <= stock + 25 ms and p99 TTFT <= stock + 60 ms
    short (#27) `full`: >= 0.9x stock tok/s, mean TTFT <= 1.5x stock, mean TPOT <= 1.1x stock
    long        `full`: >= 0.95x stock tok/s with mean TPOT within 5%; `auto`: >= 2x stock, 0 preemptions,
                0 failed.
    Values are made plain bools: vLLM's benchmark reports numpy floats, whose comparisons are numpy bools.
    A ratio that is None (stock's figure was 0: no measurement) meets no target."""
    def at_most(ratio, bound: float) -> bool:
        return ratio is not None and ratio <= bound

    def at_least(ratio, bound: float) -> bool:
        return ratio is not None and ratio >= bound

    rules = {
        "idle": lambda f: f["ttft_minus_stock_ms"] <= 25 and f["ttft_p99_minus_stock_ms"] <= 60,
        "short": lambda f: at_least(f["ratio_to_stock"], 0.9) and at_most(f["ttft_ratio_to_stock"], 1.5)
        and at_most(f["tpot_ratio_to_stock"], 1.1),
        "long": lambda f: at_least(f["ratio_to_stock"], 0.95) and at_most(f["tpot_ratio_to_stock"], 1.05),
    }
    out = {}
    for wname, arms in run.items():
        full = arms.get("full")
        if full and "ratio_to_stock" in full and wname in rules:
            out[f"{wname}.full"] = bool(rules[wname](full))
    auto = run.get("long", {}).get("auto")
    if auto and "ratio_to_stock" in auto:
        out["long.auto"] = bool(at_least(auto["ratio_to_stock"], 2.0) and auto["preemptions"] == 0
                                and auto["failed"] == 0)
    return out


def summarize(runs: list[dict]) -> dict:
    """Per workload and arm: the median of every number over the runs, and each run's values."""
    out: dict[str, dict] = {}
    for wname in runs[0]:
        arms = {}
        for arm in runs[0][wname]:
            per_run = [r[wname][arm] for r in runs]
            keys = [k for k, v in per_run[0].items() if isinstance(v, (int, float)) and v is not None]
            arms[arm] = {k: statistics.median(p[k] for p in per_run if p.get(k) is not None) for k in keys}
            groups = {g for p in per_run for g in p["cpu_s"]}
            arms[arm]["cpu_s"] = {g: statistics.median(p["cpu_s"].get(g, 0.0) for p in per_run) for g in groups}
            parts = [p["ttft_breakdown_ms"] for p in per_run if p.get("ttft_breakdown_ms")]
            if parts:   # per segment, the median over runs of its mean and of its p99
                arms[arm]["ttft_breakdown_ms"] = {
                    seg: {k: statistics.median(p[seg][k] for p in parts if seg in p and k in p[seg])
                          for k in ("mean_ms", "p99_ms") if any(k in p.get(seg, {}) for p in parts)}
                    for seg in parts[0]}
            arms[arm]["runs"] = per_run
        out[wname] = {"arms": arms}
    return out


def run_serve_bench(settings: EngineSettings, config: dict, workloads: dict[str, Workload], arms: list[str],
                    runs: int, workdir: Path, seed: int = 0, log=print, client_nice: int | None = None) -> dict:
    """`client_nice`: the benchmark client's CPU priority while it measures each arm
    (client_clock.client_priority); None: left as it is."""
    from .environment import machine_and_commit

    where = machine_and_commit()          # at the start: the code that runs, not what is checked out at the end
    workdir.mkdir(parents=True, exist_ok=True)
    per_run = []
    with stop_servers_on_signals():
        for i in range(runs):
            log(f"run {i + 1}/{runs}")
            per_run.append(one_run(arms, settings, config, workloads, workdir, seed, log, client_nice))
    checks = [targets(r) for r in per_run]
    return {"settings": {**asdict(settings), "client_nice": client_nice, **where},
            "workloads_spec": {k: asdict(w) for k, w in workloads.items()},
            "runs": runs, "workloads": summarize(per_run), "targets_per_run": checks,
            "targets_met_in_every_run": bool(checks) and all(all(c.values()) for c in checks)}
