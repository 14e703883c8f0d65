"""Live metrics: `kvtier serve --prometheus` runs the service and Debian's Prometheus on 127.0.0.1, which
scrapes Ray's metrics export port while the test sends a short, known load. Every PromQL expression of
every operations-dashboard panel (and every template variable) must return data, and the numbers must
agree with the load sent: requests and tokens per tier, a forced preemption, eviction counters equal to
the engine's own, the hang-up and the rejection. Every engine series names its deployment, vLLM's too (what
keeps two engines of one model id apart; tests/test_metric_labels.py evaluates the dashboards' queries on
two). The rollout dashboard is checked live in tests/test_rollout.py."""

from __future__ import annotations

import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")
pytest.importorskip("vllm")

from kvtier.observability import dashboards, promql  # noqa: E402
from kvtier.observability.prometheus import PrometheusAPI, binary  # noqa: E402
from prom_helpers import WINDOW, empty_panel_queries, expand, wait_for  # noqa: E402
from service_helpers import ServeProcess, free_port, run_in_thread, service_env  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900),
              pytest.mark.skipif(binary() is None, reason="Debian's prometheus is not installed (make system-deps)")]

KEY = "sk-ops"
MODEL = "tiny"
FULL_REQUESTS, FULL_TOKENS = 8, 600       # 8 x ~5 blocks > the 23-block pool: vLLM must preempt
K100_REQUESTS, K100_TOKENS = 4, 300       # compressed: K + 2r = 140 tokens (2 blocks), each round frees one
PREMIUM_REQUESTS, PREMIUM_TOKENS = 2, 40  # the second engine, serving the same model id
ENGINE, PREMIUM = "engine-cpu", "engine-premium"


def config() -> dict:
    return {
        # each CPU engine asks Ray for 2 CPUs: logical CPUs for two engines on a 2-core machine
        "server": {"load_poll_s": 0.5, "request_timeout_s": 300, "num_cpus": 4},
        "routing": {"on_pressure": "fallback"},
        "engines": {"cpu": {
            # float32 on every machine (dtype auto would pick by CPU): 12 MiB = 24 blocks of 4 KiB tokens
            "model": "tiny", "model_id": MODEL, "max_model_len": 1024, "kv_cache_bytes": "12MiB",
            "engine_kwargs": {"max_num_seqs": 8, "enforce_eager": True, "dtype": "float32"},
            "pressure": {"kv_usage": 1.0, "queue_depth": 64},
        }, "premium": {   # configs/gpu.yaml's shape: a second engine deployment of the same model id
            "model": "tiny", "model_id": MODEL, "max_model_len": 256, "kv_cache_bytes": "2MiB",
            "engine_kwargs": {"max_num_seqs": 2, "enforce_eager": True, "dtype": "float32"},
        }},
        "tiers": [
            {"name": "full", "engine": "cpu", "budget": "full"},
            {"name": "k100", "engine": "cpu", "budget": 100, "buffer": 20},
            {"name": "premium", "engine": "premium", "budget": "full", "auto": False},
        ],
        "tenants": {"ops": {"api_keys": [KEY], "admin": True}},   # reads /v1/kvtier/stats
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`kvtier serve --prometheus` (as `make serve TINY=1 PROMETHEUS=1` runs it): the service with Ray's metrics on
    metrics_port and Debian's Prometheus on prom_port scraping it every second."""
    tmp = tmp_path_factory.mktemp("obs")
    metrics_port, prom_port = free_port(), free_port()
    # Ray's default export cadence (10 s): its metrics agent keeps a gauge for two intervals, and Serve
    # refreshes its replica gauges on health checks (every 10 s), so a faster cadence would drop them
    svc = ServeProcess(config(), tmp, env=service_env(),
                       args=("--prometheus", "--prometheus-port", str(prom_port), "--metrics-port", str(metrics_port),
                             "--scrape-interval", "1"))
    prom = PrometheusAPI(f"http://127.0.0.1:{prom_port}")
    try:
        svc.wait_ready(line="kvtier serve: Prometheus at")
        assert f"Ray metrics at http://127.0.0.1:{metrics_port}/metrics" in svc.log()
        wait_for("scrape target up", lambda: [t["health"] for t in prom.targets()] == ["up"], timeout=30)
        yield svc, prom
    finally:
        prom.close()
        code = svc.stop()
        assert code == 0, svc.log()[-3000:]
        assert "kvtier serve: stopped" in svc.log()
        with pytest.raises(httpx.TransportError):       # Prometheus stopped with the service
            httpx.get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=5)


@pytest.fixture(scope="module")
def load(stack):
    """The load, sent once: what each tier must show in Prometheus."""
    svc, _ = stack
    http = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)

    def complete(tier: str, tokens: int) -> dict:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
                                               "tier": tier, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def stream(tier: str, tokens: int) -> int:
        got = 0
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Count to a thousand",
                                                           "max_tokens": tokens, "tier": tier, "stream": True,
                                                           "ignore_eos": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                assert '"usage"' not in line or '"usage":null' in line.replace(" ", ""), line  # not asked for
                got += line.startswith("data: {")
        return got

    threads = [run_in_thread(complete, "full", FULL_TOKENS) for _ in range(FULL_REQUESTS)]
    threads += [run_in_thread(stream, "k100", K100_TOKENS) for _ in range(K100_REQUESTS)]
    # one stream the client abandons, and one request with a wrong key
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Go", "max_tokens": 900,
                                                       "tier": "full", "stream": True, "ignore_eos": True}) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass
    bad = httpx.post(svc.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                     headers={"Authorization": "Bearer sk-wrong"})
    assert bad.status_code == 401
    results = []
    for t, box in threads:
        t.join(300)
        assert "error" not in box, box.get("error")
        results.append(box["result"])
    usages = results[:FULL_REQUESTS]
    assert all(u["completion_tokens"] == FULL_TOKENS for u in usages)
    assert all(n >= 1 for n in results[FULL_REQUESTS:])
    t0 = time.time()
    while True:  # the engine aborts the abandoned stream and goes idle
        st = http.get("/v1/kvtier/stats", params={"eviction": "true"}).json()["engines"]["cpu"]
        if st["running"] == 0 and st["waiting"] == 0:
            break
        assert time.time() - t0 < 60, st
        time.sleep(0.5)
    # the second engine's requests, one at a time once the first is idle: two busy engines on 2 cores can
    # starve a replica's load answers (the router then calls it down)
    for _ in range(PREMIUM_REQUESTS):
        assert complete("premium", PREMIUM_TOKENS)["completion_tokens"] == PREMIUM_TOKENS
    http.close()
    return {"full_prompt_tokens": sum(u["prompt_tokens"] for u in usages), "eviction": st["eviction"],
            "total_blocks": st["total_blocks"]}


def test_counters_agree_with_the_load(stack, load):
    _, prom = stack
    by_tier = lambda name: {s["metric"]["tier"]: float(s["value"][1])  # noqa: E731
                            for s in prom.query(f"sum by (tier) ({name})")}

    # requests per tier (the abandoned stream is a routed `full` request too) and the hang-up
    wait_for("decisions", lambda: by_tier("ray_kvtier_router_decisions_total")
              == {"full": FULL_REQUESTS + 1, "k100": K100_REQUESTS, "premium": PREMIUM_REQUESTS})
    wait_for("hang-ups", lambda: by_tier("ray_kvtier_router_cancelled_total") == {"full": 1})
    # tokens of requests answered in full (the engine's usage; the abandoned stream is not counted)
    wait_for("generated tokens", lambda: by_tier("ray_kvtier_router_generation_tokens_total")
              == {"full": FULL_REQUESTS * FULL_TOKENS, "k100": K100_REQUESTS * K100_TOKENS,
                  "premium": PREMIUM_REQUESTS * PREMIUM_TOKENS})
    prompts = wait_for("prompt tokens", lambda: by_tier("ray_kvtier_router_prompt_tokens_total"))
    assert prompts["full"] == load["full_prompt_tokens"]
    assert prompts["k100"] > 0
    wait_for("latency observations", lambda: by_tier("ray_kvtier_router_request_latency_seconds_count")
              == {"full": FULL_REQUESTS, "k100": K100_REQUESTS, "premium": PREMIUM_REQUESTS})
    wait_for("rejections", lambda: prom.value(
        'sum(ray_kvtier_router_rejections_total{status="401", reason="unauthorized"})') == 1)

    # the engine: every token it generated (warm-up and the abandoned stream included), a forced preemption;
    # the second engine's are its own (test_two_engines_of_one_model_stay_apart)
    served = FULL_REQUESTS * FULL_TOKENS + K100_REQUESTS * K100_TOKENS
    vllm_gen = f'sum(ray_vllm_generation_tokens_total{{deployment="{ENGINE}"}})'
    gen = wait_for("vLLM tokens", lambda: prom.value(vllm_gen) >= served and prom.value(vllm_gen))
    assert gen < served + 900 + 50, gen
    wait_for("preemptions", lambda: prom.value(f'sum(ray_vllm_num_preemptions_total{{deployment="{ENGINE}"}})') >= 1)

    # kvtier's eviction counters are the engine's own, exported every few seconds
    ev = load["eviction"]
    assert ev["events"] > 0 and ev["blocks_freed"] > 0, ev
    wait_for("eviction events", lambda: prom.value("sum(ray_kvtier_eviction_events_total)") == ev["events"])
    assert prom.value('sum(ray_kvtier_tokens_evicted_total{policy="random"})') == ev["tokens_evicted"]
    # the engine's own per-budget split: only the k100 tier (K = 100) evicts here
    assert prom.value('sum(ray_kvtier_tokens_evicted_total{policy="random", budget="100"})') == ev["tokens_evicted"]
    assert prom.value("sum(ray_kvtier_kv_blocks_freed_total)") == ev["blocks_freed"]
    assert (prom.value("sum(ray_kvtier_preemptions_compressed_total)") or 0) == ev["preemptions_compressed"]
    wait_for("idle pool", lambda: prom.value("sum(ray_kvtier_kv_blocks_used)") == 0
              and prom.value(f'sum(ray_kvtier_kv_blocks_free{{deployment="{ENGINE}"}})') == load["total_blocks"])
    assert prom.value("sum(ray_kvtier_eviction_round_seconds_count)") > 0
    # the batch: kvtier's gauges, refreshed on every load poll, never saw more than max_num_seqs = 8. That
    # they show a batch at all is test_running_gauge_shows_the_batch's: Ray exports them every 10 s, a sample
    # of the moment, and the load above can fit between two exports.
    peak = prom.value(f"max(max_over_time(ray_kvtier_requests_running[{WINDOW}]))")
    assert peak is not None and peak <= 8, peak
    assert prom.value("sum(ray_kvtier_requests_running)") == 0 and prom.value("sum(ray_kvtier_requests_waiting)") == 0


def test_every_operations_panel_query_returns_data(stack, load):
    _, prom = stack
    data = dashboards.to_dict(dashboards.operations())
    queries = dashboards.panel_queries(data)
    assert len(queries) >= 25
    wait_for("eviction exported", lambda: prom.value("sum(ray_kvtier_eviction_events_total)"))
    assert not (empty := empty_panel_queries(prom, queries)), empty
    for name, query in dashboards.variable_queries(data):
        selector, label = promql.label_values_arguments(expand(query))
        assert prom.label_values(label, selector), (name, query)
    assert set(prom.label_values("tier", "ray_kvtier_router_decisions_total")) == {"full", "k100", "premium"}
    # the scrape's target labels the namespace and cluster variables read (configs/prometheus.yml)
    assert prom.label_values("namespace", "ray_serve_deployment_replica_healthy") == ["local"]


def test_two_engines_of_one_model_stay_apart(stack, load):
    """Both engines serve model id `tiny`: vLLM's series carry each engine's deployment like kvtier's own
    (kvtier.service.engine_metrics), next to vLLM's model_name, engine and ReplicaId, and the dashboards'
    per-engine queries count each engine's own tokens."""
    _, prom = stack
    vllm = '{__name__=~"ray_vllm_.+"}'
    wait_for("both engines' vLLM series", lambda: len(prom.query(f"count by (deployment) ({vllm})")) == 2)
    by = prom.query(f"count by (deployment, model_name, engine) ({vllm})")
    assert sorted(s["metric"]["deployment"] for s in by) == [ENGINE, PREMIUM], by
    assert all(s["metric"]["model_name"] == MODEL and s["metric"]["engine"] == "0" for s in by), by
    assert not prom.query('{__name__=~"ray_vllm_.+", ReplicaId=""}')   # vLLM's own tag is kept
    kvtier = prom.query('count by (deployment) ({__name__=~"ray_kvtier_(kv_blocks|requests)_.+"})')
    assert sorted(s["metric"]["deployment"] for s in kvtier) == [ENGINE, PREMIUM], kvtier
    # the Tokens/s per engine panel's query: the second engine's line is its load and its warm-up (<= 2 tokens)
    data = dashboards.to_dict(dashboards.operations())
    [expr] = [e for t, e in dashboards.panel_queries(data) if t == "Tokens/s per engine" and "generation" in e]
    totals = re.sub(rf"rate\((.+?)\[{WINDOW}\]\)", r"\1", expand(expr))   # its selector and grouping, unrated
    premium = PREMIUM_REQUESTS * PREMIUM_TOKENS
    per_engine = wait_for("the second engine's tokens", lambda: (
        by := {s["metric"]["deployment"]: float(s["value"][1]) for s in prom.query(totals)}).get(PREMIUM, 0) >= premium
        and by)
    assert sorted(per_engine) == [ENGINE, PREMIUM] and per_engine[PREMIUM] <= premium + 2, per_engine
    assert per_engine[ENGINE] >= FULL_REQUESTS * FULL_TOKENS + K100_REQUESTS * K100_TOKENS, per_engine


def test_running_gauge_shows_the_batch(stack, load):
    """kvtier's running-requests gauge shows a batch of 2 to max_num_seqs = 8 requests. Ray exports it every
    10 s, a sample of the moment: the load above can fit between two exports (CI once saw a peak of 1), so
    waves of four concurrent requests are sent until an export has caught one."""
    svc, prom = stack
    expr = "max(max_over_time(ray_kvtier_requests_running[1m]))"
    body = {"model": MODEL, "prompt": "Count to a thousand", "max_tokens": 900, "tier": "k100", "ignore_eos": True}
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
        t0, waves = time.time(), 0
        while (peak := prom.value(expr) or 0) < 2:
            assert time.time() - t0 < 180, f"no export caught a batch after {waves} waves: peak {peak}"
            wave = [run_in_thread(http.post, "/v1/completions", json=body) for _ in range(4)]
            for t, box in wave:
                t.join(300)
                assert "error" not in box and box["result"].status_code == 200, box
            waves += 1
    print(f"\n[running gauge: peak {peak:g} after {waves} extra waves]")
    assert peak <= 8, peak
