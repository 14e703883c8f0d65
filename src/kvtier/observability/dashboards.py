"""Grafana dashboards as code (grafana-foundation-sdk builders): operations and RL rollout.

Every query names its metrics through `kvtier.observability.catalog` (`metric` / `series` in
`grafana_panels.py`, with the panel builders, raise on a name the catalog does not have), so a renamed
metric breaks the build, not the dashboard. `export(out_dir)` writes
one JSON file per dashboard with stable bytes (sorted keys, fixed ids and uids); the committed copies live
in `k8s/dashboards/` and become ConfigMaps for Grafana's dashboard sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import units

from .grafana_panels import (RATE, PanelIds, base_dashboard, heatmap_panel, mean, metric, quantile, rate, rate_or_zero,
                             scoped, series, stat_panel, timeseries_panel, variables)


# -- dashboards --------------------------------------------------------------------------------------
def operations() -> dm.Dashboard:
    """Batch, preemptions, tok/s per tier and engine, KV use, evictions, round time, routing, latency. Engines
    are split by `deployment`, vLLM's metrics too (two engines may serve one model id: configs/gpu.yaml)."""
    pid = PanelIds()
    every = scoped()
    dep = scoped('deployment=~"$deployment"')
    tier = scoped('tier=~"$tier"')
    d = base_dashboard("kvtier-operations", "kvtier / operations",
              "Serving under a bounded KV cache: batch, preemptions, throughput per tier and engine, KV use, "
              "eviction work, routing and latency. Metrics: docs/metrics.md.")
    d = d.variables(variables(
        "ray_serve_deployment_replica_healthy",
        ("deployment", "Engine deployment", f"label_values({metric('ray_kvtier_kv_blocks_used')}{every}, deployment)"),
        ("tier", "Tier", f"label_values({metric('ray_kvtier_router_decisions_total')}{every}, tier)"),
    ))

    d = d.with_row(db.Row("Overview").id(pid()))
    d = d.with_panel(stat_panel(pid(), "Generated tok/s", "Output tokens per second, all tiers (router).",
                           rate("ray_kvtier_router_generation_tokens_total", tier), "tok/s", "short"))
    d = d.with_panel(stat_panel(pid(), "Running requests", "Requests in the engines' running batches.",
                           f"sum({metric('ray_kvtier_requests_running')}{dep})", "running", "short"))
    d = d.with_panel(stat_panel(pid(), "Waiting requests", "Requests queued in the engines' schedulers.",
                           f"sum({metric('ray_kvtier_requests_waiting')}{dep})", "waiting", "short"))
    d = d.with_panel(stat_panel(pid(), "Healthy replicas", "Healthy Serve replicas, all deployments.",
                           f"sum({metric('ray_serve_deployment_replica_healthy')}{every})", "replicas", "short"))

    d = d.with_row(db.Row("Batch and preemption").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Batch: running and waiting requests",
        "The scheduler's running batch and waiting queue per engine deployment (kvtier's gauges: refreshed "
        "on every load poll, so an idle engine reads 0; vLLM's own are set only on engine steps).",
        [(f"sum by (deployment) ({metric('ray_kvtier_requests_running')}{dep})", "running {{deployment}}"),
         (f"sum by (deployment) ({metric('ray_kvtier_requests_waiting')}{dep})", "waiting {{deployment}}")],
        "short"))
    d = d.with_panel(timeseries_panel(
        pid(), "Preemptions/s: all and compressed",
        "All preemptions (vLLM) and preemptions of compressed requests (kvtier), per engine deployment. "
        "Reserve admission keeps compressed preemptions at 0.",
        [(rate("ray_vllm_num_preemptions_total", dep, "deployment"), "all {{deployment}}"),
         (rate_or_zero("ray_kvtier_preemptions_compressed_total", "ray_kvtier_kv_blocks_used", dep, "deployment"),
          "compressed {{deployment}}")],
        "ops"))

    d = d.with_row(db.Row("Throughput").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Tokens/s per tier", "Output and prompt tokens per second by tier (router).",
        [(rate("ray_kvtier_router_generation_tokens_total", tier, "tier"), "generated {{tier}}"),
         (rate("ray_kvtier_router_prompt_tokens_total", tier, "tier"), "prompt {{tier}}")],
        "short"))
    d = d.with_panel(timeseries_panel(
        pid(), "Tokens/s per engine", "Output and prompt (prefill, recomputation included) tokens per second "
        "by engine deployment (vLLM).",
        [(rate("ray_vllm_generation_tokens_total", dep, "deployment"), "generated {{deployment}}"),
         (rate("ray_vllm_prompt_tokens_total", dep, "deployment"), "prompt {{deployment}}")],
        "short"))

    d = d.with_row(db.Row("KV cache").id(pid()))
    used = f"sum by (deployment) ({metric('ray_kvtier_kv_blocks_used')}{dep})"
    free = f"sum by (deployment) ({metric('ray_kvtier_kv_blocks_free')}{dep})"
    d = d.with_panel(timeseries_panel(
        pid(), "KV use: vLLM and kvtier",
        "vLLM's KV-cache usage next to kvtier's true usage after reclaim, used / (used + free), per engine "
        "deployment. vLLM's figure can lag behind in-place reclaim, and vLLM sets it only on engine steps (an "
        "idle engine reads 0 here).",
        [(f"max by (deployment) ({metric('ray_vllm_kv_cache_usage_perc')}{dep}) or "
          f"(0 * max by (deployment) ({metric('ray_vllm_generation_tokens_total')}{dep}))", "vLLM {{deployment}}"),
         (f"{used} / ({used} + {free})", "kvtier {{deployment}}")],
        units.PercentUnit, min_val=0))
    d = d.with_panel(timeseries_panel(
        pid(), "KV blocks: used, free, freed/s",
        "KV blocks held and free per deployment (kvtier, after reclaim) and blocks returned by compaction "
        "per second.",
        [(used, "used {{deployment}}"), (free, "free {{deployment}}"),
         (rate("ray_kvtier_kv_blocks_freed_total", dep, "deployment"), "freed/s {{deployment}}")],
        "short"))

    d = d.with_row(db.Row("Eviction").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Eviction events/s", "Eviction rounds applied per second, by deployment, policy and budget (the "
        "engine's own split: K, or elastic:<floor>).",
        [(rate("ray_kvtier_eviction_events_total", dep, "deployment, policy, budget"),
          "{{deployment}} {{policy}} {{budget}}")],
        "ops", w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Tokens evicted/s", "KV entries evicted per KV head per second, by deployment, policy and budget "
        "(the engine's own split: K, or elastic:<floor>).",
        [(rate("ray_kvtier_tokens_evicted_total", dep, "deployment, policy, budget"),
          "{{deployment}} {{policy}} {{budget}}")],
        "short", w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Tokens evicted/s by tier", "KV entries evicted per KV head per second, by tier (the router, from "
        "each answered request's usage.kvtier): the tiers of one engine and policy apart.",
        [(rate("ray_kvtier_router_tokens_evicted_total", tier, "tier"), "{{tier}}")], "short", w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Eviction round time p50 / p99", "Wall time of one engine step's eviction work (the mean is "
        "approximate: Ray computes a histogram's sum from bucket midpoints).",
        [(quantile(0.5, "ray_kvtier_eviction_round_seconds", dep, "deployment"), "p50 {{deployment}}"),
         (quantile(0.99, "ray_kvtier_eviction_round_seconds", dep, "deployment"), "p99 {{deployment}}"),
         (mean("ray_kvtier_eviction_round_seconds", dep, "deployment"), "mean {{deployment}}")],
        units.Seconds, w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Policy failures/s", "Eviction rounds whose policy raised, per second by deployment: each "
        "finished its request with an error (the engine and the other requests keep running). Should stay 0 "
        "(alert KvtierPolicyFailures).",
        [(rate_or_zero("ray_kvtier_policy_failures_total", "ray_kvtier_kv_blocks_used", dep, "deployment"),
          "{{deployment}}")],
        "ops", w=6))

    d = d.with_row(db.Row("Elastic budgets").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Tightenings/s", "Elastic requests tightened to their floor per second, by deployment and reason: "
        "preemption (each a preemption avoided) or admission (to admit the next waiting request).",
        [(rate_or_zero("ray_kvtier_elastic_tightenings_total", "ray_kvtier_kv_blocks_used", dep, "deployment, reason"),
          "{{deployment}} {{reason}}")],
        "ops", w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Tokens evicted under pressure/s", "KV entries per KV head evicted by tightening rounds per second.",
        [(rate_or_zero("ray_kvtier_tokens_evicted_under_pressure_total", "ray_kvtier_kv_blocks_used", dep,
                       "deployment"), "{{deployment}}")],
        "short", w=6))
    d = d.with_panel(timeseries_panel(
        pid(), "Elastic requests: full / at floor", "Elastic requests held per deployment, still at full "
        "attention or tightened to their floor.",
        [(f"sum by (deployment, state) ({metric('ray_kvtier_elastic_requests')}{dep})", "{{deployment}} {{state}}")],
        "short", w=6, stack=True))
    d = d.with_panel(timeseries_panel(
        pid(), "Answered by final budget/s", "Requests answered in full per second, by tier and the budget "
        "K the engine ended them with (full: full attention to the end).",
        [(rate("ray_kvtier_router_final_budget_total", tier, "tier, budget"), "{{tier}} K={{budget}}")],
        "reqps", w=6, stack=True))

    d = d.with_row(db.Row("Routing").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Routing decisions/s", "Requests routed per second, by tier and reason.",
        [(rate("ray_kvtier_router_decisions_total", tier, "tier, reason"), "{{tier}} {{reason}}")],
        "reqps", w=8, stack=True))
    d = d.with_panel(timeseries_panel(
        pid(), "Rejections and hang-ups/s", "Requests rejected by the router per second, by HTTP status and "
        "reason, and streams the client abandoned (engine request aborted), by tier.",
        [(rate("ray_kvtier_router_rejections_total", every, "status, reason"), "{{status}} {{reason}}"),
         (rate("ray_kvtier_router_cancelled_total", tier, "tier"), "hung up {{tier}}")],
        "reqps", w=8, stack=True))
    d = d.with_panel(timeseries_panel(
        pid(), "HTTP errors/s and replicas", "Error responses of Serve's proxy per second by code, and "
        "healthy replicas per deployment.",
        [(rate("ray_serve_num_http_error_requests_total", every, "error_code"), "HTTP {{error_code}}"),
         (f"sum by (deployment) ({metric('ray_serve_deployment_replica_healthy')}{every})", "replicas {{deployment}}")],
        "short", w=8))

    d = d.with_row(db.Row("Latency").id(pid()))
    d = d.with_panel(timeseries_panel(
        pid(), "Time to first token p50 / p99",
        "Per tier as the router sees it, and inside each engine deployment (vLLM).",
        [(quantile(0.5, "ray_kvtier_router_ttft_seconds", tier, "tier"), "p50 {{tier}}"),
         (quantile(0.99, "ray_kvtier_router_ttft_seconds", tier, "tier"), "p99 {{tier}}"),
         (quantile(0.99, "ray_vllm_time_to_first_token_seconds", dep, "deployment"), "engine p99 {{deployment}}")],
        units.Seconds, w=8))
    d = d.with_panel(timeseries_panel(
        pid(), "Time to first token by segment (mean)",
        "Where the router's share of the TTFT goes, per segment: route (tier chosen), to_replica, engine "
        "(replica arrival to vLLM's first chunk), to_router. Stacked: the top is the router's TTFT.",
        [(mean("ray_kvtier_router_ttft_segment_seconds", tier, "segment"), "{{segment}}")],
        units.Seconds, w=8, stack=True))
    d = d.with_panel(timeseries_panel(
        pid(), "Time per output token p50 / p99", "Per tier as the router sees it (each stream's mean), and "
        "the inter-token latency inside each engine deployment (vLLM).",
        [(quantile(0.99, "ray_kvtier_router_tpot_seconds", tier, "tier"), "p99 {{tier}}"),
         (quantile(0.5, "ray_vllm_inter_token_latency_seconds", dep, "deployment"), "engine p50 {{deployment}}"),
         (quantile(0.99, "ray_vllm_inter_token_latency_seconds", dep, "deployment"), "engine p99 {{deployment}}")],
        units.Seconds, w=8))
    d = d.with_panel(timeseries_panel(
        pid(), "End-to-end latency p50 / p99", "Per tier as the router sees it, and inside each engine "
        "deployment (vLLM).",
        [(quantile(0.5, "ray_kvtier_router_request_latency_seconds", tier, "tier"), "p50 {{tier}}"),
         (quantile(0.99, "ray_kvtier_router_request_latency_seconds", tier, "tier"), "p99 {{tier}}"),
         (quantile(0.99, "ray_vllm_e2e_request_latency_seconds", dep, "deployment"), "engine p99 {{deployment}}")],
        units.Seconds, w=8))
    return d.build()


def rollout() -> dm.Dashboard:
    """RL rollout: tok/s, response lengths, evictions per sample, the learner-vs-sampler tail."""
    pid = PanelIds()
    every = scoped()
    d = base_dashboard("kvtier-rollout", "kvtier / RL rollout",
              "RL rollouts on the compressed engine: generation throughput, response lengths and evictions per "
              "sample. Metrics: docs/metrics.md.")
    d = d.variables(variables("ray_kvtier_rollout_generation_tokens_total"))
    d = d.with_row(db.Row("Throughput").id(pid()))
    d = d.with_panel(stat_panel(pid(), "Rollout tok/s", "Tokens generated per second by rollout servers.",
                           rate("ray_kvtier_rollout_generation_tokens_total", every), "tok/s", "short", w=6, h=8))
    d = d.with_panel(timeseries_panel(
        pid(), "Rollout tokens/s", "Tokens generated per second by rollout servers.",
        [(rate("ray_kvtier_rollout_generation_tokens_total", every), "generated")], "short", w=18))
    d = d.with_row(db.Row("Response length").id(pid()))
    n = "ray_kvtier_rollout_response_length_tokens"
    d = d.with_panel(timeseries_panel(
        pid(), "Response length p50 / p90 / p99 / mean", "Response tokens per sample. The mean is exact "
        "(generated tokens / samples); the quantiles interpolate within buckets.",
        [(quantile(0.5, n, every), "p50"), (quantile(0.9, n, every), "p90"), (quantile(0.99, n, every), "p99"),
         (f"{rate('ray_kvtier_rollout_generation_tokens_total', every)} / "
          f"sum (rate({series(n, 'count')}{every}[{RATE}]))", "mean")],
        "short"))
    d = d.with_panel(heatmap_panel(pid(), "Response length distribution", "Samples per response-length bucket.",
                              n, "short", every))
    d = d.with_row(db.Row("Evictions per sample").id(pid()))
    e = "ray_kvtier_rollout_evictions_per_sample"
    d = d.with_panel(timeseries_panel(
        pid(), "Evictions per sample p50 / p90 / p99 / mean", "Eviction rounds applied to each sample (with a "
        "budget). Ray computes a histogram's sum from bucket midpoints, so the mean is approximate.",
        [(quantile(0.5, e, every), "p50"), (quantile(0.9, e, every), "p90"), (quantile(0.99, e, every), "p99"),
         (mean(e, every), "mean")],
        "short"))
    d = d.with_panel(heatmap_panel(pid(), "Evictions per sample distribution", "Samples per eviction-count bucket.",
                              e, "short", every))
    d = d.with_row(db.Row("Learner vs sampler").id(pid()))
    lm = metric("ray_kvtier_rl_learner_mismatch")
    d = d.with_panel(timeseries_panel(
        pid(), "Per-token ratio tail (pi_learner / pi_rollout)", "The last training step's per-token ratio over "
        "response tokens: 1st percentile and minimum. Training on compressed rollouts stays stable while the "
        "lower tail stays above ~0.86 (Sparrow); learner replay keeps it at 1 up to numerics.",
        [(lm + scoped('stat="token_ratio_p01"'), "p01 {{learner}}"),
         (lm + scoped('stat="token_ratio_min"'), "min {{learner}}")],
        "short", min_val=None))
    d = d.with_panel(timeseries_panel(
        pid(), "Share of tokens below 0.86, KL", "Share of response tokens whose ratio is below 0.86, and the k3 "
        "KL(rollout || learner) per token, of the last training step.",
        [(lm + scoped('stat="share_below_0_86"'), "share < 0.86 {{learner}}"),
         (lm + scoped('stat="kl"'), "KL {{learner}}")],
        "short"))
    d = d.with_panel(timeseries_panel(
        pid(), "Samples by replay record, by path", "Training samples per second the rollout returned with a "
        "record the learner can replay, or without and why (full attention, rebuilt cache, several calls, a "
        "policy that reads the cache, no record); a dense learner replays none of them.",
        [(rate("ray_kvtier_rl_samples_replayable_total", every, "path"), "{{path}}")],
        "short", w=24, stack=True))
    return d.build()


DASHBOARDS: dict[str, Callable[[], dm.Dashboard]] = {
    "kvtier-operations": operations,
    "kvtier-rollout": rollout,
}


# -- JSON --------------------------------------------------------------------------------------------
def to_dict(dashboard: dm.Dashboard) -> dict[str, Any]:
    """The dashboard as plain JSON data (what Grafana stores)."""
    return json.loads(json.dumps(dashboard, cls=JSONEncoder))


def to_json(dashboard: dm.Dashboard) -> bytes:
    """Stable bytes: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(dashboard, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def export(out_dir: str | Path) -> list[Path]:
    """Write every dashboard as `<uid>.json` into out_dir; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, build in DASHBOARDS.items():
        path = out / f"{uid}.json"
        path.write_bytes(to_json(build()))
        paths.append(path)
    return paths


def panel_queries(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel (rows' nested panels included)."""
    out = []

    def walk(panels):
        for p in panels or []:
            for t in p.get("targets") or []:
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"]))
            walk(p.get("panels"))

    walk(data.get("panels"))
    return out


def variable_queries(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable name, query) for every query variable."""
    out = []
    for v in (data.get("templating") or {}).get("list") or []:
        if v.get("type") == "query":
            q = v.get("query")
            out.append((v["name"], q if isinstance(q, str) else (q or {}).get("query", "")))
    return out
