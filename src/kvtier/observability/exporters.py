"""Turn the engine's eviction counters into the catalog's Ray metrics.

The engine deployment calls `EngineMetricsExporter.update_load(load)` every 5 s on its own
(service/engine_upkeep.py) and on every load poll (the gauges: Ray's metrics agent drops a gauge value not
refreshed within two export intervals, so they are set far more often than that, idle or not, polled or not) and `update(snapshot, round_ms=...)` every few seconds (counters are
exported as deltas of the worker's cumulative counters; round times as histogram observations). Names and labels come from
`kvtier.observability.catalog`, so dashboards, alerts and exporters cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Callable

from .catalog import by_name

ROUND_SECONDS_BOUNDARIES = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]


def _ray_metrics():
    from ray.util import metrics

    return metrics


def catalog_metric(m, scraped: str, **kw):
    """The Ray metric (Counter, Gauge or Histogram of the metrics module `m`) that Prometheus scrapes as
    `scraped`, with the catalog's type, help and labels; kw: e.g. histogram boundaries."""
    spec = by_name(scraped)
    cls = {"counter": m.Counter, "gauge": m.Gauge, "histogram": m.Histogram}[spec.type]
    return cls(spec.ray_name, description=spec.help, tag_keys=spec.labels, **kw)


class EngineMetricsExporter:
    def __init__(self, deployment: str, metrics_module: Callable[[], Any] = _ray_metrics) -> None:
        m = metrics_module()
        self.deployment = deployment
        self.events = catalog_metric(m, "ray_kvtier_eviction_events_total")
        self.tokens = catalog_metric(m, "ray_kvtier_tokens_evicted_total")
        self.blocks_freed = catalog_metric(m, "ray_kvtier_kv_blocks_freed_total")
        self.preempted = catalog_metric(m, "ray_kvtier_preemptions_compressed_total")
        self.policy_failures = catalog_metric(m, "ray_kvtier_policy_failures_total")
        self.tightenings = catalog_metric(m, "ray_kvtier_elastic_tightenings_total")
        self.under_pressure = catalog_metric(m, "ray_kvtier_tokens_evicted_under_pressure_total")
        self.elastic = catalog_metric(m, "ray_kvtier_elastic_requests")
        self.round_seconds = catalog_metric(m, "ray_kvtier_eviction_round_seconds",
                                            boundaries=ROUND_SECONDS_BOUNDARIES)
        self.blocks_free = catalog_metric(m, "ray_kvtier_kv_blocks_free")
        self.blocks_used = catalog_metric(m, "ray_kvtier_kv_blocks_used")
        self.running = catalog_metric(m, "ray_kvtier_requests_running")
        self.waiting = catalog_metric(m, "ray_kvtier_requests_waiting")
        self._last: dict[str, float] = {}

    def _delta(self, key: str, value: float) -> float:
        prev = self._last.get(key, 0.0)
        self._last[key] = value
        return max(value - prev, 0.0)   # a restarted worker starts from 0 again

    def update(self, snapshot: dict | None, pool: dict | None = None, round_ms: list[float] | None = None) -> None:
        tags = {"deployment": self.deployment}
        if snapshot is not None:
            eng = snapshot["engine"]
            for policy, c in eng.get("by_policy", {}).items():
                # per budget label (engine/stats.budget_label); a snapshot without the split counts as "other"
                for budget, b in (c.get("by_budget") or {"other": c}).items():
                    btags = {**tags, "policy": policy, "budget": budget}
                    if d := self._delta(f"events/{policy}/{budget}", b["events"]):
                        self.events.inc(d, tags=btags)
                    if d := self._delta(f"tokens/{policy}/{budget}", b["tokens_evicted"]):
                        self.tokens.inc(d, tags=btags)
            if d := self._delta("blocks_freed", eng["blocks_freed"]):
                self.blocks_freed.inc(d, tags=tags)
            if d := self._delta("preempted", eng["preemptions_compressed"]):
                self.preempted.inc(d, tags=tags)
            if d := self._delta("policy_failures", eng.get("policy_failures", 0)):
                self.policy_failures.inc(d, tags=tags)
            for reason, n in eng.get("tightenings", {}).items():
                if d := self._delta(f"tightenings/{reason}", n):
                    self.tightenings.inc(d, tags={**tags, "reason": reason})
            if d := self._delta("under_pressure", eng.get("tokens_evicted_under_pressure", 0)):
                self.under_pressure.inc(d, tags=tags)
            at_floor, total = eng.get("elastic_at_floor", 0), eng.get("elastic_requests", 0)
            self.elastic.set(at_floor, tags={**tags, "state": "floor"})
            self.elastic.set(total - at_floor, tags={**tags, "state": "full"})
        for ms in round_ms or ():
            self.round_seconds.observe(ms / 1e3, tags=tags)
        if pool is not None:
            self.update_load(pool)

    def update_load(self, load: dict) -> None:
        """The engine's load (`kvtier_load()`): KV blocks after reclaim, running and waiting requests."""
        tags = {"deployment": self.deployment}
        self.blocks_free.set(load["free_blocks"], tags=tags)
        self.blocks_used.set(load["total_blocks"] - load["free_blocks"], tags=tags)
        if "running" in load:
            self.running.set(load["running"], tags=tags)
            self.waiting.set(load["waiting"], tags=tags)


def model_wait_reporter(deployment: str, metrics_module: Callable[[], Any] = _ray_metrics) -> Callable[[float], None]:
    """`report(seconds)`: how long a replica of `deployment` has waited for its model files (0: they are
    there), as `ray_kvtier_model_wait_seconds`; a no-op where Ray's metrics are unavailable."""
    try:
        gauge = catalog_metric(metrics_module(), "ray_kvtier_model_wait_seconds")
    except Exception:  # noqa: BLE001 - outside Ray: nothing to export to
        return lambda seconds: None
    return lambda seconds: gauge.set(seconds, tags={"deployment": deployment})


RESPONSE_LENGTH_BOUNDARIES = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
EVICTIONS_BOUNDARIES = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]   # 0.5: the bucket of zero


class RolloutMetricsExporter:
    """Per-sample rollout metrics, recorded by the rollout server as each sample finishes."""

    def __init__(self, metrics_module: Callable[[], Any] = _ray_metrics) -> None:
        m = metrics_module()
        self.tokens = catalog_metric(m, "ray_kvtier_rollout_generation_tokens_total")
        self.length = catalog_metric(m, "ray_kvtier_rollout_response_length_tokens",
                                     boundaries=RESPONSE_LENGTH_BOUNDARIES)
        self.evictions = catalog_metric(m, "ray_kvtier_rollout_evictions_per_sample", boundaries=EVICTIONS_BOUNDARIES)

    def sample(self, response_tokens: int, eviction_events: int | None) -> None:
        """One finished sample; eviction_events is None for a sample that ran without a budget."""
        if response_tokens > 0:
            self.tokens.inc(response_tokens)
        self.length.observe(response_tokens)
        if eviction_events is not None:
            self.evictions.observe(eviction_events)


class LearnerMetricsExporter:
    """Per training step, in the trainer's process: the learner-vs-sampler tail (`mismatch_metrics`) and the
    samples by the replay record the rollout returned (`replay_status`)."""

    def __init__(self, learner: str, metrics_module: Callable[[], Any] = _ray_metrics) -> None:
        m = metrics_module()
        self.learner = learner
        self.mismatch = catalog_metric(m, "ray_kvtier_rl_learner_mismatch")
        self.replayable = catalog_metric(m, "ray_kvtier_rl_samples_replayable_total")

    def step(self, mismatch: dict[str, float], replayable: dict[str, float]) -> None:
        """mismatch: {stat: value} (the `rollout/kvtier/mismatch/` names without the prefix); replayable:
        {path: samples this step} (`rollout/kvtier/replayable/`)."""
        for stat, value in mismatch.items():
            self.mismatch.set(value, tags={"stat": stat, "learner": self.learner})
        for path, count in replayable.items():
            if count:
                self.replayable.inc(count, tags={"path": path})
