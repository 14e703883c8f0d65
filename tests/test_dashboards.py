"""Dashboards as code and the metrics catalog (issue 7, item 2): catalog-only PromQL, Grafana's own models,
stable bytes, the committed copies (k8s/dashboards/, docs/metrics.md), and `kvtier dashboards push` against a
local HTTP stub. Fast: no Grafana, no Prometheus, no Ray."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk", reason="needs the ops extra: pip install -e '.[ops]'")

from kvtier.observability import catalog, dashboards, promql  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "k8s" / "dashboards"


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    return {uid: dashboards.to_dict(build()) for uid, build in dashboards.DASHBOARDS.items()}


# -- catalog -----------------------------------------------------------------------------------------
def test_catalog_names_are_unique_and_well_formed():
    names = [m.name for m in catalog.METRICS]
    assert len(names) == len(set(names))
    for m in catalog.METRICS:
        # scraped from Ray's export port, but for the RayService conditions KubeRay's operator exports
        assert m.name.startswith("kuberay_" if m.exporter == catalog.KUBERAY else "ray_"), m.name
        assert m.type in ("counter", "gauge", "histogram")
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
        assert m.help and m.exporter and m.help.endswith("."), m.name
        assert "le" not in m.labels
    series = [s for m in catalog.METRICS for s in m.series]
    assert len(series) == len(set(series))


def test_catalog_has_the_metrics_issue_7_asks_for():
    required = {
        "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_num_preemptions_total",
        "ray_vllm_generation_tokens_total", "ray_vllm_prompt_tokens_total", "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_time_to_first_token_seconds", "ray_vllm_inter_token_latency_seconds",
        "ray_vllm_e2e_request_latency_seconds",
        "ray_kvtier_eviction_events_total", "ray_kvtier_tokens_evicted_total", "ray_kvtier_kv_blocks_freed_total",
        "ray_kvtier_preemptions_compressed_total", "ray_kvtier_eviction_round_seconds", "ray_kvtier_kv_blocks_free",
        "ray_kvtier_kv_blocks_used",
        "ray_kvtier_router_decisions_total", "ray_kvtier_router_rejections_total",
        "ray_kvtier_router_generation_tokens_total", "ray_kvtier_router_prompt_tokens_total",
        "ray_kvtier_router_request_latency_seconds", "ray_kvtier_router_ttft_seconds",
        "ray_kvtier_rollout_generation_tokens_total", "ray_kvtier_rollout_response_length_tokens",
        "ray_kvtier_rollout_evictions_per_sample",
    }
    assert required <= set(catalog.BY_NAME)
    assert catalog.get("ray_kvtier_eviction_events_total").labels == ("deployment", "policy", "budget")
    assert catalog.get("ray_kvtier_router_decisions_total").labels == ("tier", "reason")
    for name in ("ray_vllm_time_to_first_token_seconds", "ray_kvtier_eviction_round_seconds",
                 "ray_kvtier_router_ttft_seconds", "ray_kvtier_rollout_evictions_per_sample"):
        assert catalog.get(name).type == "histogram"
    assert catalog.get("ray_kvtier_router_decisions_total").ray_name == "kvtier_router_decisions"
    assert catalog.get("ray_kvtier_eviction_round_seconds").ray_name == "kvtier_eviction_round_seconds"


def test_vllm_entries_match_the_installed_vllm():
    """The vLLM names exist in the installed vLLM's Prometheus logger with the type the catalog says, and
    become the catalog name after Ray's re-export (':' -> '_', 'ray_' prefix, '_total' on counters)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("vllm")      # locate, don't import (importing vLLM takes seconds)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    loggers = Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics" / "loggers.py"
    src = loggers.read_text()
    kinds = {"gauge": "_gauge_cls", "counter": "_counter_cls", "histogram": "_histogram_cls"}
    for m in catalog.by_exporter(catalog.VLLM):
        at = src.find(f'name="{m.source}"')
        assert at > 0, f"{m.source} not in {loggers}"
        before = src[:at]
        last = max(kinds.values(), key=lambda k: before.rfind(k))
        assert last == kinds[m.type], (m.name, last)
        expected = "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", m.source) + ("_total" if m.type == "counter" else "")
        assert m.name == expected
    assert "model_name" in src


def test_router_exports_every_router_metric_of_the_catalog():
    from kvtier.service import metrics as service_metrics

    exported = {name for name, _ in service_metrics._RAY_METRICS.values()}
    assert exported == {m.name for m in catalog.by_exporter(catalog.ROUTER)}


def test_docs_metrics_md_is_generated_from_the_catalog():
    committed = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == catalog.markdown(), ("docs/metrics.md is stale: "
                                             "python -m kvtier.observability.catalog > docs/metrics.md")
    for m in catalog.METRICS:
        assert f"`{m.name}`" in committed


# -- dashboards --------------------------------------------------------------------------------------
def test_every_panel_query_uses_catalog_names_only(built):
    for uid, data in built.items():
        queries = dashboards.panel_queries(data)
        assert queries, uid
        for title, expr in queries:
            assert promql.check(expr) == [], (uid, title)
        for name, query in dashboards.variable_queries(data):
            selector, label = promql.label_values_arguments(query)
            assert promql.check(selector) == [], (uid, name, query)
            metric = promql.selectors(selector)[0][0]
            assert metric in catalog.SERIES, (uid, name, query)
            assert label in catalog.SERIES[metric].all_labels + catalog.TARGET_LABELS, (uid, name, query)


def test_panel_queries_parse_with_promtool(built, tmp_path):
    """Syntax check by Prometheus itself: every panel query as a recording rule through `promtool check rules`
    (Grafana's $__rate_interval and $variables substituted)."""
    import re
    import shutil
    import subprocess

    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = []
    for uid, data in built.items():
        for i, (_, expr) in enumerate(dashboards.panel_queries(data)):
            expr = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr.replace("$__rate_interval", "5m"))
            rules.append({"record": f"kvtier:{uid.replace('-', '_')}:{i}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promql_checker_catches_strangers():
    assert promql.check('sum(rate(ray_vllm_num_preemptions_total{model_name=~"$m"}[$__rate_interval]))') == []
    assert promql.check("rate(vllm:num_preemptions[5m])")
    assert promql.check("sum by (tier) (ray_vllm_num_requests_running)")     # vLLM has no tier label
    assert promql.check("histogram_quantile(0.9, rate(ray_kvtier_router_ttft_seconds[5m]))")  # needs _bucket
    assert promql.metric_names('sum by (le) (rate(a_bucket{x="y"}[1m])) / on(x) b') == {"a_bucket", "b"}


def test_operations_dashboard_covers_the_issue(built):
    data = built["kvtier-operations"]
    exprs = " ".join(e for _, e in dashboards.panel_queries(data))
    for name in ("ray_kvtier_requests_running", "ray_kvtier_requests_waiting", "ray_vllm_num_preemptions_total",
                 "ray_kvtier_preemptions_compressed_total", "ray_kvtier_router_generation_tokens_total",
                 "ray_vllm_generation_tokens_total", "ray_vllm_kv_cache_usage_perc", "ray_kvtier_kv_blocks_used",
                 "ray_kvtier_kv_blocks_free", "ray_kvtier_eviction_events_total", "ray_kvtier_tokens_evicted_total",
                 "ray_kvtier_eviction_round_seconds_bucket", "ray_kvtier_router_decisions_total",
                 "ray_kvtier_router_rejections_total", "ray_kvtier_router_ttft_seconds_bucket",
                 "ray_vllm_inter_token_latency_seconds_bucket", "ray_kvtier_router_request_latency_seconds_bucket"):
        assert name in exprs, name
    assert "histogram_quantile(0.5, sum by (le, deployment) (rate(ray_kvtier_eviction_round_seconds_bucket" in exprs
    assert "histogram_quantile(0.99, sum by (le, deployment) (rate(ray_kvtier_eviction_round_seconds_bucket" in exprs
    rollout = " ".join(e for _, e in dashboards.panel_queries(built["kvtier-rollout"]))
    for name in ("ray_kvtier_rollout_generation_tokens_total", "ray_kvtier_rollout_response_length_tokens_bucket",
                 "ray_kvtier_rollout_evictions_per_sample_bucket"):
        assert name in rollout, name


def test_dashboard_json_round_trips_through_the_sdk_models(built):
    """Grafana's schema as the SDK models it: decoding with `Dashboard.from_json` (plugins registered) gives
    typed panels and Prometheus queries, and encoding again loses or adds nothing."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as pm

    plugins.register_default_plugins()
    for uid, data in built.items():
        model = dm.Dashboard.from_json(data)
        assert json.loads(json.dumps(model, cls=JSONEncoder)) == data, uid
        assert model.uid == uid and model.title
        ids = []
        for panel in model.panels:
            ids.append(panel.id_val)
            if isinstance(panel, dm.RowPanel):
                continue
            assert panel.targets and all(isinstance(t, pm.Dataquery) for t in panel.targets), panel.title
            assert not isinstance(panel.options, dict), (panel.title, "options not decoded by the panel plugin")
            assert panel.datasource.uid == "${datasource}"
            assert panel.grid_pos.x + panel.grid_pos.w <= 24
        assert len(ids) == len(set(ids)), uid
        variables = [v.name for v in model.templating.list_val]
        assert variables[0] == "datasource"


def test_export_is_stable_and_matches_the_committed_copy(tmp_path):
    first = dashboards.export(tmp_path / "a")
    second = dashboards.export(tmp_path / "b")
    assert [p.name for p in first] == [p.name for p in second] == [f"{uid}.json" for uid in dashboards.DASHBOARDS]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes()
        committed = COMMITTED / a.name
        assert committed.exists() and committed.read_bytes() == a.read_bytes(), (
            f"{committed} is stale: kvtier dashboards export --out k8s/dashboards")
    assert sorted(p.name for p in COMMITTED.glob("*.json")) == sorted(p.name for p in first)


def test_cli_export(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["dashboards", "export", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for uid in dashboards.DASHBOARDS:
        assert (tmp_path / f"{uid}.json").read_bytes() == (COMMITTED / f"{uid}.json").read_bytes()


# -- push --------------------------------------------------------------------------------------------
class _Grafana(BaseHTTPRequestHandler):
    """A Grafana stand-in: records every request; folders and dashboards endpoints answer like Grafana."""

    records: list[dict]
    folders: list[dict]

    def _record(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        rec = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
               "content_type": self.headers.get("Content-Type"), "body": json.loads(body) if body else None}
        self.server.records.append(rec)
        return rec

    def _answer(self, obj, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        rec = self._record()
        if rec["path"].startswith("/api/folders"):
            return self._answer(self.server.folders)
        self._answer({"message": "not found"}, 404)

    def do_POST(self):  # noqa: N802
        rec = self._record()
        if rec["auth"] != "Bearer s3cret":
            return self._answer({"message": "Unauthorized"}, 401)
        if rec["path"] == "/api/folders":
            folder = {"uid": rec["body"].get("uid", "f1"), "title": rec["body"]["title"], "id": 7}
            self.server.folders.append(folder)
            return self._answer(folder)
        if rec["path"] == "/api/dashboards/db":
            uid = rec["body"]["dashboard"]["uid"]
            return self._answer({"id": 1, "uid": uid, "url": f"/d/{uid}/x", "status": "success", "version": 1,
                                 "slug": uid})
        self._answer({"message": "not found"}, 404)

    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def grafana_stub():
    pytest.importorskip("grafana_client", reason="needs the ops extra: pip install -e '.[ops]'")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grafana)
    server.records, server.folders = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_push_uploads_every_dashboard_with_the_token(grafana_stub, built):
    from kvtier.observability.push import push

    url = f"http://127.0.0.1:{grafana_stub.server_address[1]}"
    results = push(url, "s3cret")
    posts = [r for r in grafana_stub.records if r["method"] == "POST"]
    assert [r["path"] for r in posts] == ["/api/dashboards/db"] * len(dashboards.DASHBOARDS)
    for rec, uid in zip(posts, dashboards.DASHBOARDS):
        assert rec["auth"] == "Bearer s3cret"
        assert rec["content_type"].startswith("application/json")
        assert rec["body"]["overwrite"] is True
        assert rec["body"]["dashboard"] == built[uid]
        assert "folderUid" not in rec["body"]
    assert [r["uid"] for r in results] == list(dashboards.DASHBOARDS)


def test_cli_push_into_a_new_folder(grafana_stub, built):
    from typer.testing import CliRunner

    from kvtier.cli import app

    url = f"http://127.0.0.1:{grafana_stub.server_address[1]}"
    res = CliRunner().invoke(app, ["dashboards", "push", "--url", url, "--token", "s3cret", "--folder", "kvtier LLM"])
    assert res.exit_code == 0, res.output
    recs = grafana_stub.records
    assert (recs[0]["method"], recs[0]["path"]) == ("GET", "/api/folders")
    assert (recs[1]["method"], recs[1]["path"], recs[1]["body"]) == (
        "POST", "/api/folders", {"title": "kvtier LLM", "uid": "kvtier-llm"})
    uploads = [r for r in recs if r["path"] == "/api/dashboards/db"]
    assert len(uploads) == len(dashboards.DASHBOARDS)
    assert all(r["auth"] == "Bearer s3cret" and r["body"]["folderUid"] == "kvtier-llm" for r in uploads)
    assert {r["body"]["dashboard"]["uid"] for r in uploads} == set(built)
    assert json.loads(res.output)[0]["status"] == "success"

    # a second push reuses the folder it finds
    grafana_stub.records.clear()
    res = CliRunner().invoke(app, ["dashboards", "push", "--url", url, "--token", "s3cret", "--folder", "kvtier LLM"])
    assert res.exit_code == 0, res.output
    assert [r["path"] for r in grafana_stub.records if r["method"] == "POST"] == ["/api/dashboards/db"] * 2


def test_cli_push_reports_a_refusal(grafana_stub):
    from typer.testing import CliRunner

    from kvtier.cli import app

    url = f"http://127.0.0.1:{grafana_stub.server_address[1]}"
    res = CliRunner().invoke(app, ["dashboards", "push", "--url", url, "--token", "wrong"])
    assert res.exit_code == 1
    assert "Grafana refused" in res.output
    assert grafana_stub.records[0]["auth"] == "Bearer wrong"
