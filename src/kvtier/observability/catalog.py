"""The metrics catalog: every metric kvtier's dashboards and alerts read, in one place.

Each entry is a metric as Prometheus scrapes it from Ray's metrics export port (every Ray node serves
the metrics of the actors on it), with its type, its own labels, what it means and who exports it.
Dashboards (`kvtier.observability.dashboards`), the PrometheusRule alerts (`k8s/base/monitoring/`) and
`docs/metrics.md` use these names only; tests check that.

How the scraped names arise:
- Ray prefixes every application metric with `ray_`; a Ray `Counter` is exposed as `<name>_total`,
  a `Histogram` as `<name>_bucket` / `_sum` / `_count`, a `Gauge` as `<name>`.
- vLLM metrics inside Ray Serve LLM: vLLM's `RayPrometheusStatLogger` re-creates its Prometheus metrics as
  Ray metrics and replaces `:` by `_`, so `vllm:num_preemptions` (a counter) is scraped as
  `ray_vllm_num_preemptions_total`. Labels: `model_name` (the served model id, `engines.<name>.model_id`,
  which engines may share), `engine` (engine index), `ReplicaId` (a replica's random id) and `deployment`
  (`engine-<name>`), which kvtier's subclass of that logger adds (`kvtier.engine.compat.ray_stat_logger_tagged`,
  installed by `kvtier.service.engine_metrics`).
- Metrics created with `ray.serve.metrics` inside a Serve replica get `deployment`, `replica` and
  `application` automatically (they are reserved: do not pass them as tag keys). With
  `ray.util.metrics` the exporter must add `deployment` itself.
- Ray 2.60 exports a histogram's `_sum` from bucket midpoints (its OpenTelemetry recorder keeps counts per
  bucket, not the observed values; the +Inf bucket counts as twice the last boundary), so `_sum / _count`
  is approximate; `_count` and `_bucket` are exact. Exact totals come from counters (e.g. rollout tokens).
- KubeRay's operator exports its RayService conditions itself (`kuberay_service_*`, KubeRay 1.4+), scraped
  from the operator (its Helm chart's ServiceMonitor, `honorLabels: true` keeps `namespace` the RayService's).
- Every Ray metric also carries Ray's own tags (`WorkerId`, `Component`, `NodeAddress`, `SessionName`,
  `Version`, ...) and the scrape adds target labels (`namespace`, `pod`, `instance`, `job`, and
  `ray_io_cluster` from the PodMonitor relabeling); see `RAY_LABELS` and `TARGET_LABELS`.

`python -m kvtier.observability.catalog` prints the markdown table committed as `docs/metrics.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

MetricType = Literal["counter", "gauge", "histogram"]

# Exporters (who creates the series).
VLLM = "vLLM via Ray Serve LLM"
ENGINE = "kvtier engine deployment"
ROUTER = "kvtier router"
ROLLOUT = "kvtier rollout server"
TRAINER = "kvtier verl trainer"
SERVE = "Ray Serve"
KUBERAY = "KubeRay operator"

# vLLM's labels and ReplicaId (vLLM's Ray wrappers), `deployment` (kvtier's stat logger): split engines by
# `deployment`, as kvtier's own engine metrics, since two engines may serve one model_name
VLLM_LABELS = ("model_name", "engine", "deployment", "ReplicaId")
RAY_LABELS = ("WorkerId", "Component", "NodeAddress", "SessionName", "Version", "JobId", "ip", "pid")
TARGET_LABELS = ("namespace", "pod", "instance", "job", "container", "endpoint", "service",
                 "ray_io_cluster", "ray_io_node_type")


@dataclass(frozen=True)
class Metric:
    name: str                   # as scraped, e.g. ray_kvtier_router_decisions_total
    type: MetricType
    labels: tuple[str, ...]     # the metric's own labels (without `le`, Ray's tags and target labels)
    help: str
    exporter: str               # VLLM, ENGINE, ROUTER, ROLLOUT, TRAINER, SERVE or KUBERAY
    unit: str = ""              # seconds, tokens, blocks, requests, ratio, ms, replicas ...
    source: str = ""            # the name the exporter registers (vLLM's own name for vLLM metrics)

    @property
    def ray_name(self) -> str:
        """The name to give `ray.util.metrics` / `ray.serve.metrics` (Ray adds `ray_` and `_total`)."""
        base = self.name.removeprefix("ray_")
        return base.removesuffix("_total") if self.type == "counter" else base

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name this metric produces in a scrape."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    @property
    def all_labels(self) -> tuple[str, ...]:
        return self.labels + (("le",) if self.type == "histogram" else ())


def _vllm(name: str, type_: MetricType, help_: str, unit: str = "") -> Metric:
    suffix = "_total" if type_ == "counter" else ""
    return Metric(f"ray_vllm_{name}{suffix}", type_, VLLM_LABELS, help_, VLLM, unit,
                  source=f"vllm:{name}")


METRICS: tuple[Metric, ...] = (
    # -- vLLM (Ray Serve LLM re-exports vLLM's metrics through Ray) ---------------------------------
    _vllm("num_requests_running", "gauge", "Requests in the engine's running batch (the batch size). Set on engine "
          "steps only, so absent on an idle engine: dashboards read ray_kvtier_requests_running.", "requests"),
    _vllm("num_requests_waiting", "gauge", "Requests waiting in the engine's scheduler queue (set on engine steps "
          "only; see ray_kvtier_requests_waiting).", "requests"),
    _vllm("num_preemptions", "counter", "Preemptions by the engine's scheduler (all requests; a preempted "
          "request frees its KV blocks and is recomputed).", "preemptions"),
    _vllm("generation_tokens", "counter", "Output tokens generated by the engine.", "tokens"),
    _vllm("prompt_tokens", "counter", "Prompt (prefill) tokens processed by the engine, recomputation included.",
          "tokens"),
    _vllm("kv_cache_usage_perc", "gauge", "vLLM's KV-cache usage, 0..1. Can lag after kvtier's in-place reclaim: "
          "read ray_kvtier_kv_blocks_used/free for the truth.", "ratio"),
    _vllm("time_to_first_token_seconds", "histogram", "Time to first token per request, inside the engine.",
          "seconds"),
    _vllm("inter_token_latency_seconds", "histogram", "Time between consecutive output tokens (time per output "
          "token).", "seconds"),
    _vllm("e2e_request_latency_seconds", "histogram", "Request latency inside the engine, arrival to finish.",
          "seconds"),
    # -- kvtier engine deployment --------------------------------------------------------------------
    # budget: the request's K ("512"), "elastic:<floor>" for a tightened elastic request, "other" past 16
    # distinct budgets per policy (engine/stats.budget_label): tiers that share an engine and a policy differ here
    Metric("ray_kvtier_eviction_events_total", "counter", ("deployment", "policy", "budget"),
           "Eviction rounds applied (one per request per round; every layer and KV head of the request), by "
           "the request's budget (K, or elastic:<floor>).", ENGINE, "events"),
    Metric("ray_kvtier_tokens_evicted_total", "counter", ("deployment", "policy", "budget"),
           "KV entries evicted per KV head (every head of a request evicts the same count per round), by the "
           "request's budget (K, or elastic:<floor>).", ENGINE, "tokens"),
    Metric("ray_kvtier_kv_blocks_freed_total", "counter", ("deployment",),
           "KV blocks returned to the pool by compaction (tail blocks emptied by hole filling).", ENGINE, "blocks"),
    Metric("ray_kvtier_preemptions_compressed_total", "counter", ("deployment",),
           "Preemptions of compressed (budgeted) requests; with reserve admission this should stay 0.",
           ENGINE, "preemptions"),
    Metric("ray_kvtier_policy_failures_total", "counter", ("deployment",),
           "Eviction rounds whose policy raised; the request was compacted with random and finished with an "
           "error (the engine and the other requests keep running).", ENGINE, "rounds"),
    Metric("ray_kvtier_elastic_tightenings_total", "counter", ("deployment", "reason"),
           "Elastic requests tightened to their floor (engine/elastic.py). reason=preemption: this step's running "
           "requests would not have fit, so each one is a preemption avoided; reason=admission: the next waiting "
           "request would not have fit.", ENGINE, "requests"),
    Metric("ray_kvtier_tokens_evicted_under_pressure_total", "counter", ("deployment",),
           "KV entries per KV head the tightening rounds of elastic requests evicted (a tightening compacts a "
           "full-attention cache to its floor's K + r at once).", ENGINE, "tokens"),
    Metric("ray_kvtier_elastic_requests", "gauge", ("deployment", "state"),
           "Elastic requests the engine holds, by state: full (still at full attention) or floor (tightened), as "
           "of its latest step.", ENGINE, "requests"),
    Metric("ray_kvtier_eviction_round_seconds", "histogram", ("deployment",),
           "Wall time of one engine step's eviction work (policy + compaction of every due request).",
           ENGINE, "seconds"),
    Metric("ray_kvtier_kv_blocks_free", "gauge", ("deployment",),
           "Free KV blocks in the engine's pool, counted after kvtier's reclaim (the truth vLLM's usage lags); "
           "refreshed by the replica itself every 5 s, whether or not a router polls.",
           ENGINE, "blocks"),
    Metric("ray_kvtier_kv_blocks_used", "gauge", ("deployment",),
           "KV blocks held by requests, counted after kvtier's reclaim.", ENGINE, "blocks"),
    Metric("ray_kvtier_requests_running", "gauge", ("deployment",),
           "Requests in the engine's running batch, refreshed by the replica itself every 5 s and on every load "
           "poll. vLLM sets its own num_requests_running only on engine steps, so Ray ages it out of the scrape "
           "on an idle engine; this one reads 0 instead.", ENGINE, "requests"),
    Metric("ray_kvtier_requests_waiting", "gauge", ("deployment",),
           "Requests waiting in the engine's scheduler queue, refreshed by the replica itself every 5 s and on "
           "every load poll.", ENGINE, "requests"),
    Metric("ray_kvtier_model_wait_seconds", "gauge", ("deployment",),
           "How long a replica has been waiting for its model files to appear (server.model_wait_s; the engines, "
           "and the router for its tokenizer); 0 once they are there. Refreshed every few seconds while waiting.",
           ENGINE, "seconds"),
    # -- router (the Serve ingress) ------------------------------------------------------------------
    Metric("ray_kvtier_router_decisions_total", "counter", ("tier", "reason"),
           "Requests routed, by the tier chosen and why (explicit, auto, fallback under pressure ...).",
           ROUTER, "requests"),
    Metric("ray_kvtier_router_rejections_total", "counter", ("status", "reason", "tier"),
           "Requests the router rejected or failed, by HTTP status, reason (auth, tier not allowed, no tier fits, "
           "engine unavailable ...) and the tier chosen (`none` when it failed before one was).",
           ROUTER, "requests"),
    Metric("ray_kvtier_router_generation_tokens_total", "counter", ("tier",),
           "Output tokens of requests answered in full, by tier (the engine's usage; a stream the client "
           "abandons is not counted).", ROUTER, "tokens"),
    Metric("ray_kvtier_router_prompt_tokens_total", "counter", ("tier",),
           "Prompt tokens of requests answered in full, by tier (the engine's usage).", ROUTER, "tokens"),
    Metric("ray_kvtier_router_final_budget_total", "counter", ("tier", "budget"),
           "Requests answered in full, by tier and the budget K the engine ended them with (`full`: full "
           "attention to the end; an elastic tier's requests end at full or at their floor), from the "
           "response's usage.kvtier.", ROUTER, "requests"),
    Metric("ray_kvtier_router_tokens_evicted_total", "counter", ("tier",),
           "KV entries per KV head evicted from the requests answered in full, by tier (the engine's "
           "usage.kvtier.evicted_tokens): tells apart tiers that share an engine and a policy.", ROUTER, "tokens"),
    Metric("ray_kvtier_router_cancelled_total", "counter", ("tier",),
           "Streams the client hung up on, by tier; the router aborted the engine request (its KV blocks "
           "are freed).", ROUTER, "requests"),
    Metric("ray_kvtier_router_request_latency_seconds", "histogram", ("tier",),
           "End-to-end request latency seen by the router (arrival to last byte), by tier.", ROUTER, "seconds"),
    Metric("ray_kvtier_router_ttft_seconds", "histogram", ("tier",),
           "Time to first token seen by the router (streaming: first chunk; otherwise the whole response), "
           "by tier.", ROUTER, "seconds"),
    Metric("ray_kvtier_router_ttft_segment_seconds", "histogram", ("tier", "segment"),
           "Where the time to first token goes inside the service, by tier and segment: route (router "
           "arrival to tier chosen), to_replica (to the engine replica), engine (replica arrival to vLLM's "
           "first chunk), to_router (back to the router). Their sum is the router's share of the TTFT.",
           ROUTER, "seconds"),
    Metric("ray_kvtier_router_tpot_seconds", "histogram", ("tier",),
           "Time per output token of each stream answered in full, seen by the router: (last byte - first "
           "chunk) / (output tokens - 1), by tier (streams of at least 2 tokens).", ROUTER, "seconds"),
    Metric("ray_kvtier_router_open_mode", "gauge", (),
           "1 while the router runs in open mode (`server.auth: open`: every caller gets every tier without a "
           "key), else 0; refreshed every load poll by each router replica.", ROUTER, "boolean"),
    Metric("ray_kvtier_router_engine_healthy", "gauge", ("deployment",),
           "1 while the engine deployment can serve (a replica answers the router's load poll and not every one "
           "reports its vLLM engine errored), else 0; refreshed every load poll by each router replica. An "
           "engine's health is this metric and its alert, not a readiness probe.", ROUTER, "boolean"),
    Metric("ray_kvtier_router_engine_replicas_errored", "gauge", ("deployment",),
           "Replicas of the engine deployment whose vLLM engine reports errored (Serve replaces each within its "
           "health-check period), as of the router's last load poll.", ROUTER, "replicas"),
    # -- RL rollout --------------------------------------------------------------------------------
    Metric("ray_kvtier_rollout_generation_tokens_total", "counter", (),
           "Tokens generated by rollout servers (counted per finished sample).", ROLLOUT, "tokens"),
    Metric("ray_kvtier_rollout_response_length_tokens", "histogram", (),
           "Response length per rollout sample.", ROLLOUT, "tokens"),
    Metric("ray_kvtier_rollout_evictions_per_sample", "histogram", (),
           "Eviction rounds applied to each rollout sample that ran with a budget (samples without one are "
           "not observed).", ROLLOUT, "events"),
    # -- RL learner (the v1 `kvtier_<mode>` trainers, once per step) -------------------------------------
    Metric("ray_kvtier_rl_learner_mismatch", "gauge", ("stat", "learner"),
           "The last training step's learner-vs-sampler comparison over response tokens, per-token ratio = "
           "pi_learner / pi_rollout: stat token_ratio_p01 | token_ratio_p05 | token_ratio_min | share_below_0_86 | kl | "
           "max_abs_log_ratio | seq_k3_p50 | seq_k3_p90 | seq_k3_max (over samples, each sample's mean k3: verl's "
           "seq_mean_k3); learner dense | replay (rollout.custom.kvtier.learner).", TRAINER, "ratio"),
    Metric("ray_kvtier_rl_samples_replayable_total", "counter", ("path",),
           "Training samples by the replay record the rollout returned: replayable (replayed), or not and why "
           "(full, rebuilt, multi_call, policy, no_record). What the learner did is the trainer's "
           "actor/kvtier_replay/<status>_share (a dense learner replays none).", TRAINER, "samples"),
    # -- Ray Serve's own -----------------------------------------------------------------------------
    Metric("ray_serve_deployment_replica_healthy", "gauge", ("deployment", "application", "replica"),
           "Healthy replicas per deployment (per replica 1/0 when Serve's high-cardinality tags are on; sum "
           "by deployment either way).", SERVE, "replicas", source="serve_deployment_replica_healthy"),
    Metric("ray_serve_num_http_requests_total", "counter", ("route", "method", "application", "status_code"),
           "HTTP requests answered by Serve's proxy.", SERVE, "requests", source="serve_num_http_requests"),
    Metric("ray_serve_num_http_error_requests_total", "counter", ("route", "error_code", "method", "application"),
           "HTTP requests answered with an error status by Serve's proxy.", SERVE, "requests",
           source="serve_num_http_error_requests"),
    # -- KubeRay's operator (not Ray's export port) -------------------------------------------------------
    Metric("kuberay_service_info", "gauge", ("name", "namespace", "uid"),
           "1 for every RayService the operator manages.", KUBERAY, "services", source="kuberay_service_info"),
    Metric("kuberay_service_condition_ready", "gauge", ("name", "namespace", "uid", "condition"),
           "1 with condition=\"true\" while the RayService's Ready condition holds (its Serve Service has "
           "endpoints), else 1 with condition=\"false\".", KUBERAY, "services",
           source="kuberay_service_condition_ready"),
    Metric("kuberay_service_condition_upgrade_in_progress", "gauge", ("name", "namespace", "uid", "condition"),
           "1 with condition=\"true\" while a zero-downtime upgrade runs (a pending cluster next to the active "
           "one), else 1 with condition=\"false\".", KUBERAY, "services",
           source="kuberay_service_condition_upgrade_in_progress"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
SERIES: dict[str, Metric] = {s: m for m in METRICS for s in m.series}


def get(name: str) -> Metric:
    """A catalog metric by its scraped name (KeyError names the catalog if missing)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in kvtier.observability.catalog") from None


def series(name: str, part: str = "") -> str:
    """A scraped series name, checked against the catalog: series("ray_x_seconds", "bucket")."""
    m = get(name)
    out = f"{name}_{part}" if part else name
    if out not in m.series:
        raise KeyError(f"{out!r}: {name} ({m.type}) has series {m.series}")
    return out


def by_exporter(exporter: str) -> list[Metric]:
    return [m for m in METRICS if m.exporter == exporter]


def markdown(metrics: Iterable[Metric] = METRICS) -> str:
    """The catalog as the markdown document committed as docs/metrics.md."""
    lines = [
        "# kvtier metrics",
        "",
        "<!-- generated by `python -m kvtier.observability.catalog > docs/metrics.md`; edit "
        "src/kvtier/observability/catalog.py, not this file -->",
        "",
        "Every metric the dashboards and alerts read, as Prometheus scrapes it from Ray's metrics export "
        "port (`ray_` prefix; counters end in `_total`; histograms add `_bucket`, `_sum`, `_count`), and "
        "the RayService conditions KubeRay's operator exports (`kuberay_`, scraped from the operator).",
        "Labels listed are the metric's own; Ray adds `WorkerId`, `Component`, `NodeAddress`, `SessionName`, "
        "`Version`, and the scrape adds `namespace`, `pod`, `instance`, `ray_io_cluster` (the dashboards' "
        "`namespace` and `cluster` variables). Metrics created with `ray.serve.metrics` inside a replica also "
        "get `deployment`, `replica`, `application`. Engines are told apart by `deployment` (`engine-<name>`), "
        "vLLM's metrics too: two engines may serve one `model_name`.",
        "Ray 2.60 exports a histogram's `_sum` from bucket midpoints (`_count` and `_bucket` are exact), and its "
        "metrics agent keeps a gauge value for two export intervals (`metrics_report_interval_ms`, 10 s by "
        "default): kvtier refreshes its gauges on every load poll.",
        "",
        "| name | type | labels | unit | exported by | registered as | meaning |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in metrics:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        registered = f"`{m.source or m.ray_name}`"
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {m.unit or '—'} | {m.exporter} | {registered} | "
                     f"{m.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.stdout.write(markdown())


def by_name(name: str) -> Metric:
    """The catalog entry for a scraped metric name."""
    for m in METRICS:
        if m.name == name:
            return m
    raise KeyError(f"{name!r} is not in the metrics catalog")
