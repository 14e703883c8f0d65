"""The engine exporter turns cumulative worker counters into catalog-named Ray metrics (deltas)."""

from collections import defaultdict

from kvtier.observability.catalog import by_name
from kvtier.observability.exporters import EngineMetricsExporter


class FakeMetrics:
    """Stands in for ray.util.metrics: records every call by metric name."""

    def __init__(self):
        self.calls = defaultdict(list)
        fake = self

        class _Metric:
            def __init__(self, name, description="", tag_keys=(), boundaries=None):
                self.name, self.tag_keys = name, tuple(tag_keys)

            def inc(self, value=1.0, tags=None):
                assert set(tags) == set(self.tag_keys), (self.name, tags)
                fake.calls[self.name].append(("inc", value, dict(tags)))

            def set(self, value, tags=None):
                fake.calls[self.name].append(("set", value, dict(tags)))

            def observe(self, value, tags=None):
                fake.calls[self.name].append(("observe", value, dict(tags)))

        self.Counter = self.Gauge = self.Histogram = _Metric


def snapshot(events, tokens, freed, preempted):
    return {"engine": {"by_policy": {"random": {"events": events, "tokens_evicted": tokens}},
                       "blocks_freed": freed, "preemptions_compressed": preempted}}


def test_exporter_sends_deltas_under_catalog_names():
    fake = FakeMetrics()
    exp = EngineMetricsExporter("engine-cpu", metrics_module=lambda: fake)
    exp.update(snapshot(3, 30, 2, 0), {"free_blocks": 10, "total_blocks": 16}, [1.5, 2.0])
    exp.update(snapshot(5, 50, 2, 1), {"free_blocks": 12, "total_blocks": 16}, [])
    events = by_name("ray_kvtier_eviction_events_total").ray_name
    assert [c[1] for c in fake.calls[events]] == [3, 2]
    assert fake.calls[events][0][2] == {"deployment": "engine-cpu", "policy": "random"}
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_freed_total").ray_name]] == [2]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_preemptions_compressed_total").ray_name]] == [1]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_eviction_round_seconds").ray_name]] == [0.0015, 0.002]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_used").ray_name]] == [6, 4]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_free").ray_name]] == [10, 12]
