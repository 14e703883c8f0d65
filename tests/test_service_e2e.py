"""The service end to end over HTTP on CPU: `kvtier serve` (subprocess, local Ray, Ray Serve LLM engine on
the tiny model) shared by the whole module; the official `openai` client; bad input; a schemathesis fuzz
run; client disconnects; a killed engine replica. The replica kill runs last (it restarts the engine)."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")
pytest.importorskip("vllm")

from service_helpers import ServeProcess, run_in_thread  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

MODEL = "tiny"
ALICE, BOB = "sk-alice", "sk-bob"
CONFIG = {
    # serving_nice null (Ray's own priorities: its workers, the engine's processes and the replicas alike, at
    # 15): with the default (vLLM's processes at 0, the engine replica at 19, measured best for throughput in
    # docs/serving.md) a 2-core box can starve the replica while vLLM's EngineCore spins beside its Worker;
    # CI saw a whole 1,800-token stream arrive at its end and the polled load 15 s stale. These tests are
    # about what the service does while a request runs (hang-ups, polled loads, a killed replica), not speed.
    "server": {"load_poll_s": 0.5, "request_timeout_s": 120, "serving_nice": None},
    "routing": {"min_trace_share": 0.5, "on_pressure": "fallback", "rule": "cheapest-fit"},
    "engines": {"cpu": {
        "model": "tiny", "model_id": MODEL, "max_model_len": 2048, "kv_cache_bytes": "32MiB",
        "engine_kwargs": {"max_num_seqs": 8, "enforce_eager": True},
        # KV pressure at half the pool (test_kv_pressure_* fills it; the other tests stay far below)
        "pressure": {"kv_usage": 0.5, "queue_depth": 8},
    }},
    "tiers": [
        {"name": "full", "engine": "cpu", "budget": "full"},
        {"name": "k64", "engine": "cpu", "budget": 64, "buffer": 16},     # K + r = 80, takes prompts <= 32
        {"name": "k256", "engine": "cpu", "budget": 256, "buffer": 32},   # K + r = 288, takes prompts <= 128
        {"name": "vip", "engine": "cpu", "budget": 512, "auto": False, "tenants": ["bob"]},
        # full attention until the pool runs short, then K=64 (explicit here: cheapest-fit never picks it)
        {"name": "elastic", "engine": "cpu", "budget": "elastic", "floor": 64, "buffer": 16, "tenants": ["bob"]},
    ],
    # alice is also the operator: the tests read /v1/kvtier/stats with her key (admin scope)
    "tenants": {"alice": {"api_keys": [ALICE], "tiers": ["full", "k64", "k256"], "admin": True},
                "bob": {"api_keys": [BOB]}},
}
SHORT = "Hello world, the answer is"
NO_EOS = {"ignore_eos": True}  # the random-weight tiny model samples EOS now and then; tests want full lengths


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = ServeProcess(CONFIG, tmp_path_factory.mktemp("svc"))
    try:
        svc.wait_ready()
        print(f"\n[service ready after {svc.ready_after:.0f} s]")
        yield svc
    finally:
        code = svc.stop()
        log = svc.log()
        assert "kvtier serve: stopped" in log, log[-3000:]
        assert code == 0, log[-3000:]


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.url + "/v1", api_key=ALICE, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def counter():
    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.service.tokens import PromptCounter

    return PromptCounter(str(ensure_tiny_model()))


def engine_state(http, eviction: bool = False) -> dict:
    """The engine's polled load (cheap); with `eviction`, also its eviction counters (a call into the engine)."""
    r = http.get("/v1/kvtier/stats", params={"eviction": "true"} if eviction else {})
    assert r.status_code == 200, r.text
    return r.json()["engines"]["cpu"]


def wait_idle(http, timeout=30) -> dict:
    t0 = time.time()
    while True:
        st = engine_state(http)
        if st["running"] == 0 and st["waiting"] == 0 and st["free_blocks"] == st["total_blocks"]:
            return st
        if time.time() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout} s: {st}")
        time.sleep(0.5)


def stream_headers(client, *, lines=2, **kwargs):
    """Open a streaming completion, read its headers and a few events, then hang up."""
    with client.completions.with_streaming_response.create(model=MODEL, stream=True, **kwargs) as resp:
        got = []
        for line in resp.iter_lines():  # leaving this loop closes the connection (see _hang_up_after)
            if line.startswith("data: "):
                got.append(line)
            if len(got) >= lines:
                break
        return resp.headers, got


# -- the OpenAI API -------------------------------------------------------------------------------------
def test_models_health_and_open_mode_banner(service, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert {t["name"] for t in models.data[0].model_extra["tiers"]} == {"full", "k64", "k256"}  # alice's tiers
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["open_mode"] is False
    assert "OPEN MODE" not in service.log()
    assert "Example request" in service.log() and "curl" in service.log()


def test_completion_and_streaming_chat(client):
    out = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].text and out.usage.completion_tokens == 8
    assert out.model_extra.get("kv_transfer_params") is None        # vLLM's own fields as they were
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    # the stream's usage chunk carries the request's final budget (a short chat: full attention)
    usage = chunks[-1].usage.model_dump()
    assert usage["completion_tokens"] == 8 and usage["kvtier"]["budget"] is None, usage


def test_tier_header_follows_the_routing_rule(client, http, counter):
    # short max_tokens: prompt + max_tokens <= K + r of the cheapest tier -> full attention
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=SHORT, max_tokens=8)
    assert (raw.headers["x-kvtier-tier"], raw.headers["x-kvtier-reason"]) == ("full", "short")
    # long max_tokens -> the cheapest budget that leaves half of K for the trace
    headers, events = stream_headers(client, prompt=SHORT, max_tokens=1500)
    assert (headers["x-kvtier-tier"], headers["x-kvtier-reason"]) == ("k64", "cheapest-fit") and events
    # long prompt (> 32 tokens, <= 128) -> k256, skipping k64
    long_prompt = " ".join(["seven times six is forty two and"] * 8)
    assert 32 < counter.completion(long_prompt) <= 128
    headers, _ = stream_headers(client, prompt=long_prompt, max_tokens=1500)
    assert (headers["x-kvtier-tier"], headers["x-kvtier-reason"]) == ("k256", "long-prompt")
    # chat without max_tokens runs to the model length: compressed
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Think step by step."}], stream=True) as resp:
        assert resp.headers["x-kvtier-tier"] == "k64"
    # explicit tier, as body field (openai extra_body) or header
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=SHORT, max_tokens=4,
                                                      extra_body={"tier": "k256"})
    assert (raw.headers["x-kvtier-tier"], raw.headers["x-kvtier-reason"]) == ("k256", "explicit")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=SHORT, max_tokens=4,
                                                      extra_headers={"x-kvtier-tier": "k64"})
    assert raw.headers["x-kvtier-tier"] == "k64"
    # the budget reaches the engine: a compressed request past K + r evicts
    before = engine_state(http, eviction=True)["eviction"]["events"]
    out = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=120, extra_body={"tier": "k64", **NO_EOS})
    assert out.usage.completion_tokens == 120
    assert engine_state(http, eviction=True)["eviction"]["events"] > before
    wait_idle(http)


def test_tenants_and_forbidden_tiers(service, client):
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.completions.create(model=MODEL, prompt=SHORT, max_tokens=4, extra_body={"tier": "vip"})
    assert e.value.status_code == 403 and "vip" in e.value.message
    bob = openai.OpenAI(base_url=service.url + "/v1", api_key=BOB, max_retries=0)
    raw = bob.completions.with_raw_response.create(model=MODEL, prompt=SHORT, max_tokens=4, extra_body={"tier": "vip"})
    assert raw.headers["x-kvtier-tier"] == "vip"
    for key in ("sk-nobody", ""):
        bad = openai.OpenAI(base_url=service.url + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=SHORT, max_tokens=4)


# -- bad input --------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("invalid JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    ("not an object", "/v1/completions", b'[1, 2, 3]', 400),
    ("unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404),
    ("unknown tier", "/v1/completions", {"model": MODEL, "prompt": "hi", "tier": "gold"}, 404),
    ("max_tokens beyond the model", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400),
    ("prompt longer than every tier", "/v1/completions", {"model": MODEL, "prompt": "seven " * 2100}, 400),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400),
    ("absurd max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**18}, 400),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ("huge n", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 10000}, 400),
    ("empty prompt list", "/v1/completions", {"model": MODEL, "prompt": []}, 400),
    ("negative token id", "/v1/completions", {"model": MODEL, "prompt": [1, -5]}, 400),
    ("token id beyond vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9], "max_tokens": 2}, 400),
    # vLLM's own server answers 200 and an SSE error event; before the stream starts kvtier answers 400
    ("token id beyond vocab, streamed", "/v1/completions",
     {"model": MODEL, "prompt": [1, 10**9], "max_tokens": 2, "stream": True}, 400),
    ("kvtier xargs smuggled", "/v1/completions", {"model": MODEL, "prompt": "hi", "vllm_xargs": {"kvtier_budget": 1}}, 400),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "god", "content": "x"}]}, 400),
    ("tier twice", "/v1/completions", {"model": MODEL, "prompt": "hi", "tier": "k64", "_header": "k256"}, 400),
]


@pytest.mark.parametrize("what, path, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_4xx_with_a_message(http, what, path, body, status):
    headers = {"content-type": "application/json"}
    if isinstance(body, dict) and "_header" in body:
        body = dict(body)
        headers["x-kvtier-tier"] = body.pop("_header")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers=headers)
    assert r.status_code == status, (what, r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"] and err["type"], r.text


def test_an_elastic_tier_serves_at_full_attention_when_memory_is_free(http):
    bob = {"Authorization": f"Bearer {BOB}", "x-kvtier-tier": "elastic"}
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": SHORT, "max_tokens": 40, **NO_EOS}, headers=bob)
    assert r.status_code == 200 and r.headers["x-kvtier-tier"] == "elastic", r.text[:300]
    assert r.json()["usage"]["completion_tokens"] == 40
    # its final budget, as the engine reported it (service/usage.py): full attention to the end, floor 64
    final = r.json()["usage"]["kvtier"]
    assert final["budget"] is None and final["floor"] == 64 and final["tightened"] is None, final
    # its floor (64) cannot hold a ~200-token protected prompt: a 400 naming the limit, the engine unharmed
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "seven " * 200, "max_tokens": 4}, headers=bob)
    assert r.status_code == 400 and "budget=64" in r.json()["error"]["message"], r.text[:500]
    ev = http.get("/v1/kvtier/stats", params={"eviction": "true"}).json()["engines"]["cpu"]["eviction"]
    assert not ev.get("tightenings")                     # an idle pool: nothing was tightened


def test_engine_keeps_serving_after_bad_input(client, http):
    out = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=4)
    assert out.choices[0].text
    assert http.get("/health").json()["status"] == "ok"


def _hang_up_after(client, events: int, check=None):
    """Open a long full-attention stream, read `events` SSE events, run check() while it is open, hang up.

    The line iterator is held until the hang-up on purpose: leaving `for line in resp.iter_lines()` with
    `break` drops the generator, and its close() makes httpcore close the connection right away (not at
    the end of the `with` block). That is what the old version of this helper did, so the "stream being
    served" during check() had already been hung up on: the proxy logged the client's disconnect ~0.1 s
    after the request, the engine aborted it and reported running=0 with every block free - truthfully.
    Whether check()'s first poll beat the abort decided the old, intermittent result."""
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a very long story."}], max_tokens=1800,
            stream=True, extra_body={"tier": "full", **NO_EOS}) as resp:
        lines = resp.iter_lines()
        n = 0
        for line in lines:
            n += line.startswith("data: ")
            if n >= events:  # generating: ~1800 tokens still to go (~25 s on the tiny model)
                break
        if check is not None:
            check()
            after = 0   # the stream is still being served: more events arrive
            for line in lines:
                after += line.startswith("data: ")
                if after >= 5:
                    break
            assert after >= 5, "the stream ended while check() ran"
        lines.close()   # hang up


def test_client_disconnect_mid_stream_frees_kv_blocks(client, http):
    idle = wait_idle(http)
    hung_up = http.get("/v1/kvtier/stats").json()["router"]["tiers"].get("full", {}).get("cancelled", 0)
    _hang_up_after(client, 3)
    back = wait_idle(http, timeout=30)   # hung up: the engine aborts the request and frees its blocks
    assert back["free_blocks"] == idle["free_blocks"] == idle["total_blocks"]
    # the router saw the hang-up before the stream's end and cancelled the engine request
    assert http.get("/v1/kvtier/stats").json()["router"]["tiers"]["full"]["cancelled"] == hung_up + 1


def test_polled_load_shows_a_streaming_request(client, http):
    idle = wait_idle(http)
    seen = []

    def busy():
        t0 = time.time()
        while (st := engine_state(http))["running"] != 1 and time.time() - t0 < 15:  # the router polls
            time.sleep(0.2)
        assert st["running"] == 1 and st["waiting"] == 0, json.dumps(st)
        assert st["free_blocks"] < idle["total_blocks"] and st["kv_usage"] > 0, json.dumps(st)
        assert st["in_flight"] == 1 and st["replicas"] == 1, json.dumps(st)
        seen.append(st)

    _hang_up_after(client, 3, busy)
    assert seen
    back = wait_idle(http, timeout=30)
    assert back["free_blocks"] == back["total_blocks"] and back["in_flight"] == 0


def test_fuzz_openapi_schema_finds_no_5xx(service, http):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    failures, calls = [], 0

    def bounded(case):
        """Keep generation cheap: the property is about status codes, not long outputs."""
        body = case.body
        if isinstance(body, dict):
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
                    body[key] = 4
            if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
                body["max_tokens"] = 4
            if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
                body["n"] = 2

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal calls
                bounded(case)
                resp = case.call(headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
                calls += 1
                if resp.status_code >= 500:
                    failures.append((op.label, mode.value, case.body, resp.status_code, resp.text[:300]))

            try:
                run()
            except Unsatisfiable:  # nothing to break (e.g. negative data for a GET without parameters)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    print(f"\n[fuzz: {calls} calls]")
    assert calls >= 100
    assert not failures, failures[:5]
    assert http.get("/health").json()["status"] == "ok"
    wait_idle(http, timeout=60)


# -- KV pressure ---------------------------------------------------------------------------------------------
def _ids(n: int, salt: int) -> list[int]:
    """A token-id prompt of exactly n tokens (the router counts ids as they are)."""
    return [10 + (salt * 7919 + i * 31) % 4000 for i in range(n)]


def test_kv_pressure_falls_back_to_a_smaller_budget(service, http):
    """Long full-attention requests fill more than half the pool (the engine's pressure threshold, read
    from the polled load); an automatically routed request that would go to full attention is then served
    by the largest compressed tier whose KV bound is smaller (k256), says so in its headers, and completes;
    once the pool drains the same request goes to full attention again."""
    idle = wait_idle(http)
    threshold = CONFIG["engines"]["cpu"]["pressure"]["kv_usage"]
    # 200 prompt tokens leave under half of every K for the trace -> no compressed fit -> full attention
    # (KV bound 200 + 200); under pressure k256 holds the prompt with a bound of min(400, 256 + 2*32) = 320.
    probe = {"model": MODEL, "prompt": _ids(200, 0), "max_tokens": 200, **NO_EOS}

    def route_of(body) -> tuple[str, str]:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:  # headers only
            assert r.status_code == 200, r.read()
            return r.headers["x-kvtier-tier"], r.headers["x-kvtier-reason"]

    assert route_of(probe) == ("full", "no-compressed-fit")
    wait_idle(http)

    # 6 x 1600 prompt tokens = 13 blocks each once prefilled, growing to 16: more than half of the pool's
    # 63 blocks (float32 on a CPU without native bf16) or 127 (bfloat16) once four of them run
    def long_full(i):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": _ids(1600, i + 1), "max_tokens": 400,
                                               "tier": "full", **NO_EOS}, timeout=600)
        return r.status_code, r.headers.get("x-kvtier-tier"), r.json()

    fillers = [run_in_thread(long_full, i) for i in range(6)]
    t0 = time.time()
    # every condition: the pool can pass the threshold with five fillers prefilled before the router has
    # handed the sixth to the engine (seen in CI: in_flight 5, kv_usage 0.51), or with three while the
    # fourth's prefill is still being scheduled (seen in CI: running 3, kv_usage 0.52 of 63 blocks)
    while ((st := engine_state(http))["kv_usage"] < threshold or st["in_flight"] < 6 or st["running"] < 4):
        assert time.time() - t0 < 120, f"pool never reached {threshold} with 4 running of 6 in flight: {json.dumps(st)}"
        assert all(t.is_alive() for t, _ in fillers), [box for _, box in fillers]
        time.sleep(0.2)

    # under pressure: a stream, then (once the stream is routed) a whole response, both through the fallback
    # tier. One after the other: sent together, the second was once routed only after the fillers had
    # finished (CI, 2026-12-04: routed 5 s late, no pressure left, full attention)
    out = {"events": 0, "finish": None, "done": False}

    def streamed():
        with http.stream("POST", "/v1/completions", json={**probe, "stream": True}, timeout=600) as s:
            out["status"], out["headers"] = s.status_code, dict(s.headers)
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    out["events"] += 1
                    for choice in event.get("choices") or []:
                        out["finish"] = choice.get("finish_reason") or out["finish"]
                out["done"] = out["done"] or line == "data: [DONE]"
        return out

    def whole():
        r = http.post("/v1/completions", json=probe, timeout=600)
        return r.status_code, dict(r.headers), r.json()

    probes = [run_in_thread(streamed)]
    while "headers" not in out:                       # the router answers with headers once it has routed
        assert probes[0][0].is_alive(), probes[0][1]
        time.sleep(0.05)
    assert all(t.is_alive() for t, _ in fillers), "the fillers finished before the stream was routed"
    probes.append(run_in_thread(whole))
    for t, _ in probes:
        t.join(600)
        assert not t.is_alive()
    (_, st), (_, w) = probes
    assert "error" not in w and "error" not in st, (w, st)
    status, headers, body = w["result"]
    assert status == 200, body
    assert (headers["x-kvtier-tier"], headers["x-kvtier-reason"]) == ("k256", "pressure-fallback"), headers
    assert "under KV pressure" in headers["x-kvtier-detail"] and "full -> k256" in headers["x-kvtier-detail"]
    assert body["usage"]["completion_tokens"] == 200 and body["choices"][0]["finish_reason"] == "length", body
    out = st["result"]
    assert out["status"] == 200
    assert (out["headers"]["x-kvtier-tier"], out["headers"]["x-kvtier-reason"]) == ("k256", "pressure-fallback")
    assert out["done"] and out["finish"] == "length" and out["events"] >= 50, out

    for t, box in fillers:   # the long requests complete too
        t.join(600)
        assert not t.is_alive()
        status, tier, out = box["result"]
        assert status == 200 and tier == "full" and out["usage"]["completion_tokens"] == 400, out

    decisions = http.get("/v1/kvtier/stats").json()["router"]["decisions"]
    fallback = [d for d in decisions if d["reason"] == "pressure-fallback"]
    assert fallback and fallback[0]["tier"] == "k256" and fallback[0]["count"] >= 2, decisions
    back = wait_idle(http, timeout=60)   # every block back in the pool
    assert back["free_blocks"] == back["total_blocks"] == idle["total_blocks"]
    assert route_of(probe) == ("full", "no-compressed-fit")   # no pressure, no fallback
    wait_idle(http)


# -- disconnects and engine failures ----------------------------------------------------------------------
def _wait_engine_back(http) -> None:
    """After a replica is killed: poll until a request succeeds; meanwhile every answer is a quick 503."""
    t0, statuses = time.time(), []
    while True:
        t = time.time()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": SHORT, "max_tokens": 4}, timeout=60)
        assert time.time() - t < 60
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert time.time() - t0 < 600, f"engine not back after 600 s: {statuses[-5:]}"
        time.sleep(2)
    print(f"\n[engine back after {time.time() - t0:.0f} s; {len(statuses) - 1} requests answered 503 meanwhile]")
    assert r.headers["x-kvtier-tier"] == "full"
    assert http.get("/health").json()["status"] == "ok"


def test_killed_engine_replica_restarts_and_in_flight_requests_get_503(service, client, http):
    def long_completion():
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": SHORT, "max_tokens": 1800, "tier": "full",
                                               **NO_EOS})
        return r.status_code, r.json()

    def long_stream():
        got = 0
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                                    max_tokens=1800, stream=True, extra_body=NO_EOS):
            got += 1
        return got

    # The kill must land while both requests generate. The load reading that says they run passes through
    # the router and the engine replica, which with the engine holding both cores can answer seconds late:
    # CI once saw the completion finish before the kill (200). Such a try proves nothing; try again.
    for attempt in range(3):
        wait_idle(http, timeout=60)
        [replica] = service.find("ServeReplica:kvtier:engine-cpu")
        cores = service.find("VLLM::EngineCore")
        t1, plain = run_in_thread(long_completion)
        t2, streamed = run_in_thread(long_stream)
        t0 = time.time()
        while engine_state(http)["running"] < 2:
            assert time.time() - t0 < 60, "requests never started"
            time.sleep(0.2)
        replica.kill()                                    # SIGKILL the Serve replica hosting the engine
        t1.join(60)
        t2.join(60)
        assert not t1.is_alive() and not t2.is_alive(), "in-flight requests hung"
        status, body = plain["result"]
        if status != 200 and "result" not in streamed:
            break
        if status == 200:   # finished before the kill, never a cut-short answer passed off as whole
            assert body["usage"]["completion_tokens"] == 1800, body
        print(f"\n[try {attempt}: a request finished before the kill reached the engine; trying again]")
        _wait_engine_back(http)
    assert status == 503 and body["error"]["code"] == "engine-unavailable", body
    assert isinstance(streamed.get("error"), openai.APIError), streamed   # an SSE error event ends the stream
    assert "unavailable" in str(streamed["error"]) or "went away" in str(streamed["error"])

    _wait_engine_back(http)   # Serve replaces the replica; meanwhile requests get a quick 503, never hang
    for p in cores:                                   # the dead replica's engine processes are gone
        assert not p.is_running() or p.status() == "zombie", p
