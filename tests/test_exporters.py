"""The engine exporter turns cumulative worker counters into catalog-named Ray metrics (deltas)."""

import json
from collections import defaultdict

import pytest

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

            def _record(self, kind, value, tags):
                tags = dict(tags or {})
                assert set(tags) == set(self.tag_keys), (self.name, tags)
                fake.calls[self.name].append((kind, value, tags))

            def inc(self, value=1.0, tags=None):
                self._record("inc", value, tags)

            def set(self, value, tags=None):
                self._record("set", value, tags)

            def observe(self, value, tags=None):
                self._record("observe", value, tags)

        self.Counter = self.Gauge = self.Histogram = _Metric


def snapshot(events, tokens, freed, preempted, failures=0):
    return {"engine": {"by_policy": {"random": {"events": events, "tokens_evicted": tokens}},
                       "blocks_freed": freed, "preemptions_compressed": preempted, "policy_failures": failures}}


def test_exporter_sends_deltas_under_catalog_names():
    fake = FakeMetrics()
    exp = EngineMetricsExporter("engine-cpu", metrics_module=lambda: fake)
    exp.update(snapshot(3, 30, 2, 0), {"free_blocks": 10, "total_blocks": 16}, [1.5, 2.0])
    exp.update(snapshot(5, 50, 2, 1, failures=1), {"free_blocks": 12, "total_blocks": 16}, [])
    events = by_name("ray_kvtier_eviction_events_total").ray_name
    assert [c[1] for c in fake.calls[events]] == [3, 2]
    assert fake.calls[events][0][2] == {"deployment": "engine-cpu", "policy": "random", "budget": "other"}
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_freed_total").ray_name]] == [2]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_preemptions_compressed_total").ray_name]] == [1]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_policy_failures_total").ray_name]] == [1]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_eviction_round_seconds").ray_name]] == [0.0015, 0.002]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_used").ray_name]] == [6, 4]
    assert [c[1] for c in fake.calls[by_name("ray_kvtier_kv_blocks_free").ray_name]] == [10, 12]


def test_exporter_refreshes_load_gauges_on_every_poll():
    fake = FakeMetrics()
    exp = EngineMetricsExporter("engine-cpu", metrics_module=lambda: fake)
    exp.update_load({"free_blocks": 16, "total_blocks": 16, "running": 0, "waiting": 0})
    exp.update_load({"free_blocks": 9, "total_blocks": 16, "running": 3, "waiting": 2})
    tags = {"deployment": "engine-cpu"}
    assert fake.calls[by_name("ray_kvtier_requests_running").ray_name] == [("set", 0, tags), ("set", 3, tags)]
    assert fake.calls[by_name("ray_kvtier_requests_waiting").ray_name] == [("set", 0, tags), ("set", 2, tags)]
    assert fake.calls[by_name("ray_kvtier_kv_blocks_used").ray_name] == [("set", 0, tags), ("set", 7, tags)]



def test_router_takes_usage_from_the_stream_and_drops_the_chunk_unless_asked():
    pytest.importorskip("ray.serve")
    from kvtier.service.sse import take_usage

    token = 'data: {"choices":[{"index":0,"text":"a"}],"usage":null}\n\n'
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    last = f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'
    assert take_usage(token, keep_usage_chunk=False) == (token, None)
    assert take_usage(last, keep_usage_chunk=False) == ("data: [DONE]\n\n", usage)
    assert take_usage(last, keep_usage_chunk=True) == (last, usage)
    only = f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'
    assert take_usage(only, keep_usage_chunk=False) == ("", usage)


def test_router_metrics_count_tokens_latency_and_hang_ups_per_tier(monkeypatch):
    from kvtier.service import metrics as service_metrics

    fake = FakeMetrics()
    monkeypatch.setattr(service_metrics, "_ray_metrics", lambda: {
        attr: getattr(fake, "Counter")(by_name(name).ray_name, tag_keys=by_name(name).labels)
        for attr, (name, _) in service_metrics._RAY_METRICS.items()})
    m = service_metrics.RouterMetrics()
    m.decision("k64", "explicit")
    m.first_token("k64", 0.2)
    m.finished("k64", 1.5, {"prompt_tokens": 12, "completion_tokens": 30})
    m.finished("k64", 0.5, None)        # an engine that reported no usage: latency only
    m.finished("k64", 2.2, {"completion_tokens": 11}, first_token_s=0.2)   # a stream: 10 tokens after the first
    m.finished("k64", 0.3, {"completion_tokens": 1}, first_token_s=0.3)    # one token: no time per token
    m.finished("elastic", 1.0, {"completion_tokens": 5, "kvtier": {"budget": 256, "floor": 256,
                                                                  "evicted_tokens": 700}})  # tightened
    m.finished("elastic", 1.0, {"completion_tokens": 5, "kvtier": {"budget": None, "floor": 256}})  # full to the end
    m.cancelled("full")
    m.rejection(401, "unauthorized")
    m.rejection(503, "engine-unavailable", "k64")
    snap = m.snapshot()
    zero = {"tokens_evicted": 0}
    assert snap["tiers"] == {"full": {"finished": 0, "prompt_tokens": 0, "generation_tokens": 0, "cancelled": 1, **zero},
                             "k64": {"finished": 4, "prompt_tokens": 12, "generation_tokens": 42, "cancelled": 0, **zero},
                             "elastic": {"finished": 2, "prompt_tokens": 0, "generation_tokens": 10, "cancelled": 0,
                                         "tokens_evicted": 700}}
    assert snap["final_budgets"] == [{"tier": "elastic", "budget": "256", "count": 1},
                                     {"tier": "elastic", "budget": "full", "count": 1}]
    c = fake.calls
    assert [v for _, v, _ in c["kvtier_router_generation_tokens"]] == [30, 11, 1, 5, 5]
    assert c["kvtier_router_final_budget"] == [("inc", 1, {"tier": "elastic", "budget": "256"}),
                                               ("inc", 1, {"tier": "elastic", "budget": "full"})]
    assert c["kvtier_router_prompt_tokens"] == [("inc", 12, {"tier": "k64"})]
    assert c["kvtier_router_tokens_evicted"] == [("inc", 700, {"tier": "elastic"})]   # evictions per tier
    assert [v for _, v, _ in c["kvtier_router_request_latency_seconds"]] == [1.5, 0.5, 2.2, 0.3, 1.0, 1.0]
    assert c["kvtier_router_tpot_seconds"] == [("observe", pytest.approx(0.2), {"tier": "k64"})]
    assert c["kvtier_router_ttft_seconds"] == [("observe", 0.2, {"tier": "k64"})]
    assert c["kvtier_router_cancelled"] == [("inc", 1, {"tier": "full"})]
    assert c["kvtier_router_rejections"] == [
        ("inc", 1, {"status": "401", "reason": "unauthorized", "tier": "none"}),        # before any tier was chosen
        ("inc", 1, {"status": "503", "reason": "engine-unavailable", "tier": "k64"})]


def test_router_exports_open_mode_and_keeps_it_fresh(monkeypatch):
    """`kvtier_router_open_mode` is set at start and again every poll interval: Ray drops a gauge value
    nobody refreshes, and the alert KvtierOpenMode reads it."""
    import asyncio

    from kvtier.service import metrics as service_metrics

    fake = FakeMetrics()
    monkeypatch.setattr(service_metrics, "_ray_metrics", lambda: {
        attr: fake.Gauge(by_name(name).ray_name, tag_keys=by_name(name).labels)
        for attr, (name, _) in service_metrics._RAY_METRICS.items()})

    engines = {"engine-a": (True, 0), "engine-b": (True, 1)}

    async def run(open_mode: bool) -> None:
        task = service_metrics.RouterMetrics().keep_gauges(open_mode, every_s=0.01, engines=lambda: dict(engines))
        await asyncio.sleep(0.055)
        task.cancel()

    asyncio.run(run(True))
    engines["engine-b"] = (False, 3)      # every replica of b errored: its alert's input goes to 0
    asyncio.run(run(False))
    sets = fake.calls[by_name("ray_kvtier_router_open_mode").ray_name]
    assert len(sets) >= 6 and {v for _, v, _ in sets} == {1.0, 0.0} and all(t == {} for _, _, t in sets)
    assert sets[0][1] == 1.0 and sets[-1][1] == 0.0
    healthy = fake.calls[by_name("ray_kvtier_router_engine_healthy").ray_name]
    errored = fake.calls[by_name("ray_kvtier_router_engine_replicas_errored").ray_name]
    last = {t["deployment"]: v for _, v, t in healthy}
    assert last == {"engine-a": 1.0, "engine-b": 0.0} and {t["deployment"]: v for _, v, t in errored}["engine-b"] == 3


def test_rollout_exporter_records_each_sample_under_catalog_names():
    from kvtier.observability.exporters import RolloutMetricsExporter

    fake = FakeMetrics()
    exp = RolloutMetricsExporter(metrics_module=lambda: fake)
    exp.sample(160, 5)
    exp.sample(0, None)       # aborted/empty and uncompressed: length observed, no evictions, no tokens
    names = {m: by_name(m).ray_name for m in ("ray_kvtier_rollout_generation_tokens_total",
                                              "ray_kvtier_rollout_response_length_tokens",
                                              "ray_kvtier_rollout_evictions_per_sample")}
    c = fake.calls
    assert c[names["ray_kvtier_rollout_generation_tokens_total"]] == [("inc", 160, {})]
    assert c[names["ray_kvtier_rollout_response_length_tokens"]] == [("observe", 160, {}), ("observe", 0, {})]
    assert c[names["ray_kvtier_rollout_evictions_per_sample"]] == [("observe", 5, {})]


def test_learner_exporter_sends_the_steps_tail_and_scored_samples():
    """The v1 trainers' per-step learner metrics (`rollout/kvtier/mismatch/*`, `replay/*`) as catalog gauges
    and counters, labelled with the learner."""
    from kvtier.observability.exporters import LearnerMetricsExporter
    from kvtier.rollout.trainer_hooks import export_learner_metrics

    fake = FakeMetrics()
    exp = LearnerMetricsExporter("replay", metrics_module=lambda: fake)
    export_learner_metrics(exp, {"rollout/kvtier/mismatch/token_ratio_p01": 0.99, "rollout/kvtier/mismatch/kl": 1e-6,
                                 "rollout/kvtier/replayable/replayed": 16.0, "rollout/kvtier/replayable/rebuilt": 0.0,
                                 "rollout/kvtier/eviction_events/mean": 3.0})
    c = fake.calls
    assert c[by_name("ray_kvtier_rl_learner_mismatch").ray_name] == [
        ("set", 0.99, {"stat": "token_ratio_p01", "learner": "replay"}), ("set", 1e-6, {"stat": "kl", "learner": "replay"})]
    assert c[by_name("ray_kvtier_rl_samples_replayable_total").ray_name] == [("inc", 16.0, {"path": "replayed"})]


def test_engine_counts_evictions_per_budget_and_the_exporter_labels_them():
    """Tiers that share an engine and a policy (k512, k1024, elastic on one engine) are told apart by the
    engine's own counters: one `budget` label per K (elastic requests as elastic:<floor>), bounded per policy."""
    from kvtier.engine.stats import MAX_BUDGET_LABELS, EvictionStats, budget_label

    stats = EvictionStats()
    stats.record_round("a", "random", 10, budget_label(512))
    stats.record_round("a", "random", 10, budget_label(512))
    stats.record_round("b", "random", 7, budget_label(1024))
    stats.record_round("c", "random", 5, budget_label(512, floor=512))
    by_budget = stats.engine.by_policy["random"]["by_budget"]
    assert by_budget == {"512": {"events": 2, "tokens_evicted": 20}, "1024": {"events": 1, "tokens_evicted": 7},
                         "elastic:512": {"events": 1, "tokens_evicted": 5}}
    assert stats.engine.by_policy["random"]["tokens_evicted"] == 32
    fake = FakeMetrics()
    exp = EngineMetricsExporter("engine-cpu", metrics_module=lambda: fake)
    exp.update(stats.snapshot())
    stats.record_round("a", "random", 10, budget_label(512))
    exp.update(stats.snapshot())
    tokens = fake.calls[by_name("ray_kvtier_tokens_evicted_total").ray_name]
    per_label = {}
    for _, value, tags in tokens:
        per_label[tags["budget"]] = per_label.get(tags["budget"], 0) + value
    assert per_label == {"512": 30, "1024": 7, "elastic:512": 5}
    # a client sending a new K on every request adds at most MAX_BUDGET_LABELS series per policy
    for k in range(100, 100 + 2 * MAX_BUDGET_LABELS):
        stats.record_round("d", "random", 1, budget_label(k))
    labels = stats.engine.by_policy["random"]["by_budget"]
    assert len(labels) == MAX_BUDGET_LABELS + 1 and labels["other"]["events"] == 2 * MAX_BUDGET_LABELS - 13
