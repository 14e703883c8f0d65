"""Grafana dashboards as code (grafana-foundation-sdk builders): operations and RL rollout.

Every query names its metrics through `kvtier.observability.catalog` (`_m` / `_s` raise on a name the
catalog does not have), so a renamed metric breaks the build, not the dashboard. `export(out_dir)` writes
one JSON file per dashboard with stable bytes (sorted keys, fixed ids and uids); the committed copies live
in `k8s/dashboards/` and become ConfigMaps for Grafana's dashboard sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm
from grafana_foundation_sdk.models import units

from . import catalog

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
TAGS = ["kvtier"]


def _m(name: str) -> str:
    """A catalog metric name (KeyError if the catalog lacks it)."""
    return catalog.get(name).name


def _s(name: str, part: str) -> str:
    """A catalog series name: _s("ray_kvtier_eviction_round_seconds", "bucket")."""
    return catalog.series(name, part)


def _rate(name: str, sel: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({_m(name)}{sel}[{RATE}]))"


def _rate_or_zero(name: str, zero_like: str, sel: str = "", by: str = "") -> str:
    """_rate, or 0 for every series of `zero_like` (a gauge with the same grouping) while the counter has
    never been incremented (Ray exports a counter only after its first increment): the panel shows a 0
    line instead of "No data"."""
    grouping = f" by ({by})" if by else ""
    return f"{_rate(name, sel, by)} or (0 * sum{grouping} ({_m(zero_like)}{sel}))"


def _quantile(q: float, name: str, sel: str = "", by: str = "") -> str:
    by = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({by}) (rate({_s(name, 'bucket')}{sel}[{RATE}])))"


def _mean(name: str, sel: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return (f"sum{grouping} (rate({_s(name, 'sum')}{sel}[{RATE}])) / "
            f"sum{grouping} (rate({_s(name, 'count')}{sel}[{RATE}]))")


# -- panels ------------------------------------------------------------------------------------------
class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _target(ref: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref).expr(expr).legend_format(legend).range().datasource(DATASOURCE)


def _timeseries(pid: int, title: str, description: str, queries: list[tuple[str, str]], unit: str, *,
                w: int = 12, h: int = 8, min_val: float | None = 0, stack: bool = False) -> timeseries.Panel:
    panel = (
        timeseries.Panel().id(pid).title(title).description(description).datasource(DATASOURCE)
        .unit(unit).span(w).height(h).line_width(1).fill_opacity(10).show_points(cm.VisibilityMode.NEVER)
        .legend(cb.VizLegendOptions().show_legend(True).display_mode(cm.LegendDisplayMode.TABLE)
                .placement(cm.LegendPlacement.BOTTOM).calcs(["mean", "lastNotNull", "max"]))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if stack:
        panel = panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_target(chr(ord("A") + i), expr, legend))
    return panel


def _stat(pid: int, title: str, description: str, expr: str, legend: str, unit: str, *, w: int = 6,
          h: int = 4) -> stat.Panel:
    return (
        stat.Panel().id(pid).title(title).description(description).datasource(DATASOURCE).unit(unit)
        .span(w).height(h).graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(_target("A", expr, legend))
    )


def _heatmap(pid: int, title: str, description: str, name: str, unit: str, *, w: int = 12,
             h: int = 8) -> heatmap.Panel:
    expr = f"sum by (le) (increase({_s(name, 'bucket')}[{RATE}]))"
    return (
        heatmap.Panel().id(pid).title(title).description(description).datasource(DATASOURCE)
        .span(w).height(h).calculate(False)
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges")
               .steps(64))
        .cell_values(heatmap.CellValues().unit("short")).show_tooltip().show_y_histogram().show_legend()
        .scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LINEAR))
        .with_target(prometheus.Dataquery().ref_id("A").expr(expr).legend_format("{{le}}")
                     .format(pm.PromQueryFormat.HEATMAP).range().datasource(DATASOURCE))
    )


def _variables(*names: tuple[str, str, str]) -> list:
    out: list = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")]
    for name, label, query in names:
        out.append(
            db.QueryVariable(name).label(label).query(query).datasource(DATASOURCE)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
        )
    return out


def _base(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title).uid(uid).description(description).tags(TAGS).editable()
        .refresh("30s").time("now-1h", "now").timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(db.DashboardLink("kvtier").type(dm.DashboardLinkType.DASHBOARDS).tags(TAGS).as_dropdown(True)
              .include_vars(True).keep_time(True))
    )


# -- dashboards --------------------------------------------------------------------------------------
def operations() -> dm.Dashboard:
    """Batch, preemptions, tok/s per tier and engine, KV use, evictions, round time, routing, latency."""
    pid = _Ids()
    model = '{model_name=~"$model_name"}'
    dep = '{deployment=~"$deployment"}'
    tier = '{tier=~"$tier"}'
    d = _base("kvtier-operations", "kvtier / operations",
              "Serving under a bounded KV cache: batch, preemptions, throughput per tier and engine, KV use, "
              "eviction work, routing and latency. Metrics: docs/metrics.md.")
    d = d.variables(_variables(
        ("model_name", "Engine (model id)", f"label_values({_m('ray_vllm_generation_tokens_total')}, model_name)"),
        ("deployment", "Engine deployment", f"label_values({_m('ray_kvtier_kv_blocks_used')}, deployment)"),
        ("tier", "Tier", f"label_values({_m('ray_kvtier_router_decisions_total')}, tier)"),
    ))

    d = d.with_row(db.Row("Overview").id(pid()))
    d = d.with_panel(_stat(pid(), "Generated tok/s", "Output tokens per second, all tiers (router).",
                           _rate("ray_kvtier_router_generation_tokens_total", tier), "tok/s", "short"))
    d = d.with_panel(_stat(pid(), "Running requests", "Requests in the engines' running batches.",
                           f"sum({_m('ray_kvtier_requests_running')}{dep})", "running", "short"))
    d = d.with_panel(_stat(pid(), "Waiting requests", "Requests queued in the engines' schedulers.",
                           f"sum({_m('ray_kvtier_requests_waiting')}{dep})", "waiting", "short"))
    d = d.with_panel(_stat(pid(), "Healthy replicas", "Healthy Serve replicas, all deployments.",
                           f"sum({_m('ray_serve_deployment_replica_healthy')})", "replicas", "short"))

    d = d.with_row(db.Row("Batch and preemption").id(pid()))
    d = d.with_panel(_timeseries(
        pid(), "Batch: running and waiting requests",
        "The scheduler's running batch and waiting queue per engine deployment (kvtier's gauges: refreshed "
        "on every load poll, so an idle engine reads 0; vLLM's own are set only on engine steps).",
        [(f"sum by (deployment) ({_m('ray_kvtier_requests_running')}{dep})", "running {{deployment}}"),
         (f"sum by (deployment) ({_m('ray_kvtier_requests_waiting')}{dep})", "waiting {{deployment}}")],
        "short"))
    d = d.with_panel(_timeseries(
        pid(), "Preemptions/s: all and compressed",
        "All preemptions (vLLM, per engine) and preemptions of compressed requests (kvtier, per deployment). "
        "Reserve admission keeps compressed preemptions at 0.",
        [(_rate("ray_vllm_num_preemptions_total", model, "model_name"), "all {{model_name}}"),
         (_rate_or_zero("ray_kvtier_preemptions_compressed_total", "ray_kvtier_kv_blocks_used", dep, "deployment"),
          "compressed {{deployment}}")],
        "ops"))

    d = d.with_row(db.Row("Throughput").id(pid()))
    d = d.with_panel(_timeseries(
        pid(), "Tokens/s per tier", "Output and prompt tokens per second by tier (router).",
        [(_rate("ray_kvtier_router_generation_tokens_total", tier, "tier"), "generated {{tier}}"),
         (_rate("ray_kvtier_router_prompt_tokens_total", tier, "tier"), "prompt {{tier}}")],
        "short"))
    d = d.with_panel(_timeseries(
        pid(), "Tokens/s per engine", "Output and prompt (prefill, recomputation included) tokens per second "
        "by engine (vLLM).",
        [(_rate("ray_vllm_generation_tokens_total", model, "model_name"), "generated {{model_name}}"),
         (_rate("ray_vllm_prompt_tokens_total", model, "model_name"), "prompt {{model_name}}")],
        "short"))

    d = d.with_row(db.Row("KV cache").id(pid()))
    used = f"sum by (deployment) ({_m('ray_kvtier_kv_blocks_used')}{dep})"
    free = f"sum by (deployment) ({_m('ray_kvtier_kv_blocks_free')}{dep})"
    d = d.with_panel(_timeseries(
        pid(), "KV use: vLLM and kvtier",
        "vLLM's KV-cache usage per engine next to kvtier's true usage after reclaim, used / (used + free) "
        "per deployment. vLLM's figure can lag behind in-place reclaim, and vLLM sets it only on engine "
        "steps (an idle engine reads 0 here).",
        [(f"max by (model_name) ({_m('ray_vllm_kv_cache_usage_perc')}{model}) or "
          f"(0 * max by (model_name) ({_m('ray_vllm_generation_tokens_total')}{model}))", "vLLM {{model_name}}"),
         (f"{used} / ({used} + {free})", "kvtier {{deployment}}")],
        units.PercentUnit, min_val=0))
    d = d.with_panel(_timeseries(
        pid(), "KV blocks: used, free, freed/s",
        "KV blocks held and free per deployment (kvtier, after reclaim) and blocks returned by compaction "
        "per second.",
        [(used, "used {{deployment}}"), (free, "free {{deployment}}"),
         (_rate("ray_kvtier_kv_blocks_freed_total", dep, "deployment"), "freed/s {{deployment}}")],
        "short"))

    d = d.with_row(db.Row("Eviction").id(pid()))
    d = d.with_panel(_timeseries(
        pid(), "Eviction events/s", "Eviction rounds applied per second, by deployment and policy.",
        [(_rate("ray_kvtier_eviction_events_total", dep, "deployment, policy"), "{{deployment}} {{policy}}")],
        "ops", w=8))
    d = d.with_panel(_timeseries(
        pid(), "Tokens evicted/s", "KV entries evicted per KV head per second, by deployment and policy.",
        [(_rate("ray_kvtier_tokens_evicted_total", dep, "deployment, policy"), "{{deployment}} {{policy}}")],
        "short", w=8))
    d = d.with_panel(_timeseries(
        pid(), "Eviction round time p50 / p99", "Wall time of one engine step's eviction work (the mean is "
        "approximate: Ray computes a histogram's sum from bucket midpoints).",
        [(_quantile(0.5, "ray_kvtier_eviction_round_seconds", dep, "deployment"), "p50 {{deployment}}"),
         (_quantile(0.99, "ray_kvtier_eviction_round_seconds", dep, "deployment"), "p99 {{deployment}}"),
         (_mean("ray_kvtier_eviction_round_seconds", dep, "deployment"), "mean {{deployment}}")],
        units.Seconds, w=8))

    d = d.with_row(db.Row("Routing").id(pid()))
    d = d.with_panel(_timeseries(
        pid(), "Routing decisions/s", "Requests routed per second, by tier and reason.",
        [(_rate("ray_kvtier_router_decisions_total", tier, "tier, reason"), "{{tier}} {{reason}}")],
        "reqps", w=8, stack=True))
    d = d.with_panel(_timeseries(
        pid(), "Rejections and hang-ups/s", "Requests rejected by the router per second, by HTTP status and "
        "reason, and streams the client abandoned (engine request aborted), by tier.",
        [(_rate("ray_kvtier_router_rejections_total", "", "status, reason"), "{{status}} {{reason}}"),
         (_rate("ray_kvtier_router_cancelled_total", tier, "tier"), "hung up {{tier}}")],
        "reqps", w=8, stack=True))
    d = d.with_panel(_timeseries(
        pid(), "HTTP errors/s and replicas", "Error responses of Serve's proxy per second by code, and "
        "healthy replicas per deployment.",
        [(_rate("ray_serve_num_http_error_requests_total", "", "error_code"), "HTTP {{error_code}}"),
         (f"sum by (deployment) ({_m('ray_serve_deployment_replica_healthy')})", "replicas {{deployment}}")],
        "short", w=8))

    d = d.with_row(db.Row("Latency").id(pid()))
    d = d.with_panel(_timeseries(
        pid(), "Time to first token p50 / p99",
        "Per tier as the router sees it, and inside each engine (vLLM).",
        [(_quantile(0.5, "ray_kvtier_router_ttft_seconds", tier, "tier"), "p50 {{tier}}"),
         (_quantile(0.99, "ray_kvtier_router_ttft_seconds", tier, "tier"), "p99 {{tier}}"),
         (_quantile(0.99, "ray_vllm_time_to_first_token_seconds", model, "model_name"), "engine p99 {{model_name}}")],
        units.Seconds, w=8))
    d = d.with_panel(_timeseries(
        pid(), "Time per output token p50 / p99", "Inter-token latency inside each engine (vLLM).",
        [(_quantile(0.5, "ray_vllm_inter_token_latency_seconds", model, "model_name"), "p50 {{model_name}}"),
         (_quantile(0.99, "ray_vllm_inter_token_latency_seconds", model, "model_name"), "p99 {{model_name}}")],
        units.Seconds, w=8))
    d = d.with_panel(_timeseries(
        pid(), "End-to-end latency p50 / p99", "Per tier as the router sees it, and inside each engine (vLLM).",
        [(_quantile(0.5, "ray_kvtier_router_request_latency_seconds", tier, "tier"), "p50 {{tier}}"),
         (_quantile(0.99, "ray_kvtier_router_request_latency_seconds", tier, "tier"), "p99 {{tier}}"),
         (_quantile(0.99, "ray_vllm_e2e_request_latency_seconds", model, "model_name"), "engine p99 {{model_name}}")],
        units.Seconds, w=8))
    return d.build()


def rollout() -> dm.Dashboard:
    """RL rollout: tok/s, response lengths, evictions per sample."""
    pid = _Ids()
    d = _base("kvtier-rollout", "kvtier / RL rollout",
              "RL rollouts on the compressed engine: generation throughput, response lengths and evictions per "
              "sample. Metrics: docs/metrics.md.")
    d = d.variables(_variables())
    d = d.with_row(db.Row("Throughput").id(pid()))
    d = d.with_panel(_stat(pid(), "Rollout tok/s", "Tokens generated per second by rollout servers.",
                           _rate("ray_kvtier_rollout_generation_tokens_total"), "tok/s", "short", w=6, h=8))
    d = d.with_panel(_timeseries(
        pid(), "Rollout tokens/s", "Tokens generated per second by rollout servers.",
        [(_rate("ray_kvtier_rollout_generation_tokens_total"), "generated")], "short", w=18))
    d = d.with_row(db.Row("Response length").id(pid()))
    n = "ray_kvtier_rollout_response_length_tokens"
    d = d.with_panel(_timeseries(
        pid(), "Response length p50 / p90 / p99 / mean", "Response tokens per sample. The mean is exact "
        "(generated tokens / samples); the quantiles interpolate within buckets.",
        [(_quantile(0.5, n), "p50"), (_quantile(0.9, n), "p90"), (_quantile(0.99, n), "p99"),
         (f"{_rate('ray_kvtier_rollout_generation_tokens_total')} / sum (rate({_s(n, 'count')}[{RATE}]))", "mean")],
        "short"))
    d = d.with_panel(_heatmap(pid(), "Response length distribution", "Samples per response-length bucket.",
                              n, "short"))
    d = d.with_row(db.Row("Evictions per sample").id(pid()))
    e = "ray_kvtier_rollout_evictions_per_sample"
    d = d.with_panel(_timeseries(
        pid(), "Evictions per sample p50 / p90 / p99 / mean", "Eviction rounds applied to each sample (with a "
        "budget). Ray computes a histogram's sum from bucket midpoints, so the mean is approximate.",
        [(_quantile(0.5, e), "p50"), (_quantile(0.9, e), "p90"), (_quantile(0.99, e), "p99"), (_mean(e), "mean")],
        "short"))
    d = d.with_panel(_heatmap(pid(), "Evictions per sample distribution", "Samples per eviction-count bucket.",
                              e, "short"))
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
