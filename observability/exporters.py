"""Turn the engine's eviction counters into the catalog's Ray metrics.

The engine deployment calls `EngineMetricsExporter.update(snapshot, pool)` periodically (counters are
exported as deltas of the worker's cumulative counters; round times as histogram observations; gauges
are refreshed every call, since Ray drops a gauge that is not updated). Names and labels come from
`kvtier.observability.catalog`, so dashboards, alerts and exporters cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Callable

from .catalog import by_name

ROUND_SECONDS_BOUNDARIES = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]


def _ray_metrics():
    from ray.util import metrics

    return metrics


class EngineMetricsExporter:
    def __init__(self, deployment: str, metrics_module: Callable[[], Any] = _ray_metrics) -> None:
        m = metrics_module()
        self.deployment = deployment

        def make(scraped: str, kind: str, **kw):
            spec = by_name(scraped)
            cls = {"counter": m.Counter, "gauge": m.Gauge, "histogram": m.Histogram}[kind]
            return cls(spec.ray_name, description=spec.help, tag_keys=spec.labels, **kw)

        self.events = make("ray_kvtier_eviction_events_total", "counter")
        self.tokens = make("ray_kvtier_tokens_evicted_total", "counter")
        self.blocks_freed = make("ray_kvtier_kv_blocks_freed_total", "counter")
        self.preempted = make("ray_kvtier_preemptions_compressed_total", "counter")
        self.round_seconds = make("ray_kvtier_eviction_round_seconds", "histogram",
                                  boundaries=ROUND_SECONDS_BOUNDARIES)
        self.blocks_free = make("ray_kvtier_kv_blocks_free", "gauge")
        self.blocks_used = make("ray_kvtier_kv_blocks_used", "gauge")
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
                ptags = {**tags, "policy": policy}
                if d := self._delta(f"events/{policy}", c["events"]):
                    self.events.inc(d, tags=ptags)
                if d := self._delta(f"tokens/{policy}", c["tokens_evicted"]):
                    self.tokens.inc(d, tags=ptags)
            if d := self._delta("blocks_freed", eng["blocks_freed"]):
                self.blocks_freed.inc(d, tags=tags)
            if d := self._delta("preempted", eng["preemptions_compressed"]):
                self.preempted.inc(d, tags=tags)
        for ms in round_ms or ():
            self.round_seconds.observe(ms / 1e3, tags=tags)
        if pool is not None:
            self.blocks_free.set(pool["free_blocks"], tags=tags)
            self.blocks_used.set(pool["total_blocks"] - pool["free_blocks"], tags=tags)
