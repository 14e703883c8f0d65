"""Labels that separate (issue #41, item 3): vLLM's metrics carry the engine deployment (kvtier's stat logger),
every dashboard query is scoped to the `namespace` and `cluster` variables, and the dashboards' vLLM queries,
evaluated by Prometheus' own engine (`promtool test rules`) on two engines serving one model id, return one
series per engine. The alerts' two-engine cases are in k8s/base/monitoring/rule-tests/ (tests/test_alerts.py);
tests/test_observability_live.py checks the label on a live engine's series."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from kvtier.observability import catalog, dashboards, promql

SCOPE = {"namespace", "ray_io_cluster"}
ENGINES = ("engine-shared", "engine-premium")   # configs/gpu.yaml: both serve model id qwen3-8b


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    pytest.importorskip("grafana_foundation_sdk", reason="needs the ops extra: pip install -e '.[ops]'")
    return {uid: dashboards.to_dict(build()) for uid, build in dashboards.DASHBOARDS.items()}


# -- dashboards ---------------------------------------------------------------------------------------
def test_every_query_is_scoped_to_namespace_and_cluster(built):
    for uid, data in built.items():
        names = [name for name, _ in dashboards.variable_queries(data)]
        assert names[:2] == ["namespace", "cluster"], uid
        for title, expr in dashboards.panel_queries(data):
            for series, labels in promql.selectors(expr):
                assert SCOPE <= labels, (uid, title, series, expr)
        for name, query in dashboards.variable_queries(data)[1:]:   # each narrowed by the variables before it
            selector, _ = promql.label_values_arguments(query)
            assert 'namespace=~"$namespace"' in selector, (uid, name, query)


def test_vllm_queries_group_by_deployment_not_model_name(built):
    vllm = [(t, e) for t, e in dashboards.panel_queries(built["kvtier-operations"]) if "ray_vllm_" in e]
    assert len(vllm) >= 8
    for title, expr in vllm:
        assert "model_name" not in expr, (title, expr)
        assert re.search(r"by \((le, )?deployment\)", expr), (title, expr)


def _input_series() -> list[dict]:
    """Every vLLM series the catalog lists, for two engines serving one model id in one namespace and cluster:
    counters and histograms rise (engine-premium twice as fast), gauges hold."""
    out = []
    for k, dep in enumerate(ENGINES, start=1):
        labels = (f'namespace="kvtier", ray_io_cluster="kvtier-raycluster-a", model_name="qwen3-8b", engine="0", '
                  f'ReplicaId="r{k}", deployment="{dep}"')
        for m in catalog.by_exporter(catalog.VLLM):
            if m.type == "histogram":
                for le in ("0.1", "1", "+Inf"):
                    out.append({"series": f'{m.name}_bucket{{{labels}, le="{le}"}}', "values": f"0+{k}x20"})
                out.append({"series": f"{m.name}_count{{{labels}}}", "values": f"0+{k}x20"})
                out.append({"series": f"{m.name}_sum{{{labels}}}", "values": f"0+{k}x20"})
            else:
                out.append({"series": f"{m.name}{{{labels}}}", "values": f"0+{k}x20" if m.type == "counter"
                            else f"{k / 10}x20"})
    return out


def test_vllm_queries_keep_two_engines_of_one_model_apart(built, tmp_path):
    """Each vLLM query of the operations dashboard as an alert rule (it fires once per result series; promtool
    compares the alerts' labels): one result per engine deployment, none merged."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    queries = [(t, e) for t, e in dashboards.panel_queries(built["kvtier-operations"]) if "ray_vllm_" in e]
    rules, cases = [], []
    for i, (title, expr) in enumerate(queries):
        expr = expr.replace("$__rate_interval", "5m")
        expr = re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", expr)   # every variable at "All"
        rules.append({"alert": f"Q{i}", "expr": expr, "annotations": {"panel": title}})
        cases.append({"eval_time": "15m", "alertname": f"Q{i}", "exp_alerts": [
            {"exp_labels": {"deployment": dep}, "exp_annotations": {"panel": title}} for dep in ENGINES]})
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": _input_series(), "alert_rule_test": cases}]}))
    proc = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the stat logger ------------------------------------------------------------------------------------
@pytest.fixture
def vllm_config(tiny_model_dir):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model_dir, max_model_len=256, enforce_eager=True).create_engine_config()


def _wrappers(obj, seen=None):
    """Every vLLM Ray metric wrapper reachable from a stat logger's attributes (labeled ones included)."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusMetric

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, RayPrometheusMetric):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _wrappers(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _wrappers(v, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("vllm.", "kvtier.")):
        for v in vars(obj).values():
            yield from _wrappers(v, seen)


def test_stat_logger_tags_every_series_with_its_deployment(vllm_config, monkeypatch):
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    from kvtier.service import engine_metrics

    monkeypatch.setattr(engine_metrics, "serve_deployment", lambda: "engine-shared")
    logger = engine_metrics.stat_logger(vllm_config, [0])
    wrappers = list(_wrappers(logger))
    names = {w.metric._name for w in wrappers}
    assert {m.source.replace(":", "_") for m in catalog.by_exporter(catalog.VLLM)} <= names
    for w in wrappers:
        assert w.metric._tag_keys[-2:] == ("ReplicaId", "deployment"), w.metric._name
        assert w._tags["deployment"] == "engine-shared", w.metric._name
    labeled = [w for w in wrappers if w._is_labeled and "model_name" in w._tags]
    assert labeled and all(w._tags["model_name"] == vllm_config.model_config.served_model_name for w in labeled)
    logger.log_engine_initialized()
    logger.record(SchedulerStats(num_running_reqs=1), IterationStats(), engine_idx=0)   # every tag key given


def test_install_puts_it_in_place_of_vllms_prometheus_logger(vllm_config, monkeypatch):
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    from kvtier.service import engine_metrics

    monkeypatch.setattr(engine_metrics, "serve_deployment", lambda: "engine-premium")
    manager = StatLoggerManager(vllm_config)      # what AsyncLLM builds with Ray Serve LLM's logger off
    others = [x for x in manager.stat_loggers if not isinstance(x, PrometheusStatLogger)]
    installed = engine_metrics.install(manager, vllm_config)
    assert [x for x in manager.stat_loggers if isinstance(x, PrometheusStatLogger)] == [installed]
    assert manager.stat_loggers == [*others, installed]
