"""The service's pure parts: config validation, the routing rule (no Ray, no vLLM); API keys: test_service_auth.py."""

from pathlib import Path

import pytest

from kvtier.service.config import ConfigError, load_config, parse_bytes, parse_config
from kvtier.service.routing import EngineLoad, RequestShape, RouteError, aggregate_loads, engine_load, kv_bound, route

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "kvtier" / "configs"


def make_cfg(**over):
    data = {
        "engines": {"cpu": {"model": "tiny", "model_id": "m", "max_model_len": 4096,
                            "pressure": {"kv_usage": 0.8, "queue_depth": 4}}},
        "tiers": [
            {"name": "full", "engine": "cpu", "budget": "full"},
            {"name": "small", "engine": "cpu", "budget": 256, "buffer": 64},
            {"name": "big", "engine": "cpu", "budget": 1024, "buffer": 64},
            {"name": "lab", "engine": "cpu", "budget": 512, "policy": "snapkv", "auto": False},
        ],
        "tenants": {"alice": {"api_keys": ["sk-a"], "tiers": ["full", "small"]},
                    "bob": {"api_keys": ["sk-b"]}},
        "routing": {"min_trace_share": 0.5, "rule": "cheapest-fit"},
    }
    data.update(over)
    return parse_config(data)


ALL = {"full", "small", "big", "lab"}


def decide(cfg, prompt, max_tokens, tier=None, allowed=ALL, loads=None, model=None):
    return route(cfg, RequestShape(prompt, max_tokens, model, tier), allowed, loads)


# -- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.tiers and cfg.engines
    assert any(not t.compressed for t in cfg.tiers) and any(t.compressed for t in cfg.tiers)


def test_local_config_is_open_mode_on_one_cpu_engine():
    cfg = load_config(CONFIGS / "local.yaml")
    assert cfg.open_mode and len(cfg.engines) == 1 and 2 <= len(cfg.tiers) <= 4
    assert cfg.routing.rule == "headroom" and [t.name for t in cfg.tiers if t.elastic] == ["elastic"]
    assert next(iter(cfg.engines.values())).accelerator == "cpu"


@pytest.mark.parametrize("patch, needle", [
    ({"tiers": [{"name": "x", "engine": "nope"}]}, "unknown engine"),
    ({"tiers": [{"name": "x", "engine": "cpu", "budget": 0}]}, "budget"),
    ({"tiers": [{"name": "x", "engine": "cpu", "budget": 8192}]}, "max_model_len"),
    ({"tiers": [{"name": "x", "engine": "cpu"}, {"name": "x", "engine": "cpu"}]}, "duplicate"),
    ({"tiers": [{"name": "x", "engine": "cpu", "tenants": ["ghost"]}]}, "unknown tenants"),
    ({"tenants": {"t": {"tiers": ["ghost"]}}}, "unknown tiers"),
    ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "share an API key"),
    ({"routing": {"min_trace_share": 1.5}}, "min_trace_share"),
    ({"routing": {"typo": 1}}, "typo"),
])
def test_bad_configs_name_the_field(patch, needle):
    with pytest.raises(ConfigError, match=needle):
        make_cfg(**patch)


@pytest.mark.parametrize("server, direct, router_nice", [
    ({}, True, 0),                                              # the default, auto, on a local Ray: direct, router at 0
    ({"ingress": "proxy"}, False, 19),                          # Serve's proxy, router at the serving nice value
    ({"ingress": "auto", "router_replicas": 2}, False, 19),     # auto with two routers: Serve's proxy
    ({"ingress": "auto", "ray_address": "auto"}, False, 19),    # auto on a joined cluster: Serve's proxy
    ({"ingress": "direct", "router_nice": 7}, True, 7),
    ({"ingress": "proxy", "serving_nice": None}, False, None),  # no nice values at all
])
def test_ingress_auto_resolves_and_the_router_nice_follows_it(server, direct, router_nice):
    cfg = make_cfg(server=server).server
    assert (cfg.direct_ingress, cfg.router_nice_value) == (direct, router_nice)


@pytest.mark.parametrize("server", [{"ingress": "direct", "router_replicas": 2},
                                    {"ingress": "direct", "ray_address": "auto"}])
def test_direct_ingress_where_it_cannot_be_is_refused_by_name(server):
    with pytest.raises(ConfigError, match="server.ingress 'direct'"):
        make_cfg(server=server)


def test_bad_engine_kwargs_and_eviction_are_rejected():
    with pytest.raises(ConfigError, match="max_model_len"):
        make_cfg(engines={"cpu": {"max_model_len": 4096, "engine_kwargs": {"max_model_len": 1}}})
    with pytest.raises(ConfigError, match="admission"):
        make_cfg(engines={"cpu": {"max_model_len": 4096, "eviction": {"admission": "sometimes"}}})


def test_bytes_and_yaml_errors(tmp_path):
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("1G") == 10**9 and parse_bytes("4096") == 4096
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_a_model_path_starting_with_a_dot_is_relative_to_the_config_file(tmp_path, monkeypatch):
    # a model directory carries its own service.yaml (`kvtier bench rl-export`): "." must survive a clone or move
    d = tmp_path / "exports" / "m"
    d.mkdir(parents=True)
    engines = {"here": ".", "sibling": "../other", "hub": "Qwen/Qwen3-8B", "shipped": "reasoner-long", "abs": "/models/x"}
    (d / "service.yaml").write_text("server: {auth: open}\nengines:\n" + "".join(
        f"  {n}: {{model: {m}, max_model_len: 256}}\n" for n, m in engines.items())
        + "tiers:\n" + "".join(f"- {{name: t-{n}, engine: {n}, budget: full}}\n" for n in engines))
    monkeypatch.chdir(tmp_path)                       # not the file's directory
    cfg = load_config(Path("exports/m/service.yaml"))
    got = {n: e.model for n, e in cfg.engines.items()}
    assert got == {"here": str(d.resolve()), "sibling": str((tmp_path / "exports" / "other").resolve()),
                   "hub": "Qwen/Qwen3-8B", "shipped": "reasoner-long", "abs": "/models/x"}


def test_tier_extra_args_fit_openai_vllm_xargs():
    cfg = make_cfg()
    assert cfg.tier("full").extra_args() == {"kvtier_budget": "full"}
    lab = cfg.tier("lab").model_copy(update={"params": {"window": 8}, "protect_prompt": True})
    xargs = lab.extra_args()
    assert xargs["kvtier_budget"] == 512 and xargs["kvtier_policy"] == "snapkv"
    assert xargs["kvtier_protect_prompt"] == 1 and xargs["kvtier_params"] == '{"window": 8}'
    assert all(isinstance(v, (str, int, float)) for v in xargs.values())


# -- routing rule ----------------------------------------------------------------------------------------
def test_short_request_goes_to_full_attention():
    cfg = make_cfg()
    d = decide(cfg, prompt=20, max_tokens=200)          # 220 <= K+r = 320 of the cheapest fitting tier
    assert (d.tier.name, d.reason) == ("full", "short")
    d = decide(cfg, prompt=20, max_tokens=300)          # exactly K + r
    assert (d.tier.name, d.reason) == ("full", "short")


def test_long_generation_goes_to_the_cheapest_fitting_budget():
    cfg = make_cfg()
    d = decide(cfg, prompt=20, max_tokens=301)
    assert (d.tier.name, d.reason) == ("small", "cheapest-fit")
    d = decide(cfg, prompt=20, max_tokens=None)         # chat default: up to the model length
    assert (d.tier.name, d.reason) == ("small", "cheapest-fit")


def test_long_prompt_skips_budgets_it_would_crowd():
    cfg = make_cfg()
    d = decide(cfg, prompt=129, max_tokens=2000)        # > (1 - 0.5) * 256
    assert (d.tier.name, d.reason) == ("big", "long-prompt")
    d = decide(cfg, prompt=128, max_tokens=2000)        # exactly half of K still fits
    assert d.tier.name == "small"
    d = decide(cfg, prompt=400, max_tokens=600)         # 1000 <= K+r of big: compression cannot pay
    assert (d.tier.name, d.reason) == ("full", "short")
    d = decide(cfg, prompt=600, max_tokens=3000)        # no compressed tier leaves room
    assert (d.tier.name, d.reason) == ("full", "no-compressed-fit")


def test_trace_share_is_tunable():
    cfg = make_cfg(routing={"min_trace_share": 0.25, "rule": "cheapest-fit"})
    assert decide(cfg, prompt=192, max_tokens=2000).tier.name == "small"
    assert decide(cfg, prompt=193, max_tokens=2000).tier.name == "big"


def test_without_a_full_tier_short_requests_take_the_cheapest_budget():
    cfg = make_cfg()
    d = decide(cfg, prompt=20, max_tokens=10, allowed={"small", "big"})
    assert (d.tier.name, d.reason) == ("small", "cheapest-fit")
    with pytest.raises(RouteError) as e:
        decide(cfg, prompt=600, max_tokens=3000, allowed={"small", "big"})
    assert (e.value.status, e.value.reason) == (400, "prompt-too-long")


def test_explicit_tier_allowance_and_lengths():
    cfg = make_cfg()
    d = decide(cfg, prompt=20, max_tokens=10, tier="big")
    assert (d.tier.name, d.reason) == ("big", "explicit")
    assert decide(cfg, 20, 10, tier="lab").tier.name == "lab"           # auto: false tiers are explicit-only
    assert decide(cfg, 20, 3000).tier.name != "lab"
    for tier, status, reason in [("big", 403, "forbidden-tier"), ("nope", 404, "unknown-tier")]:
        with pytest.raises(RouteError) as e:
            decide(cfg, 20, 10, tier=tier, allowed={"full", "small"})
        assert (e.value.status, e.value.reason, e.value.param) == (status, reason, "tier")
    with pytest.raises(RouteError) as e:
        decide(cfg, 20, 4077, tier="small")
    assert (e.value.status, e.value.reason) == (400, "context-too-long")


@pytest.mark.parametrize("prompt, max_tokens, reason", [(4096, None, "prompt-too-long"), (10, 4087, "context-too-long"),
                                                        (10, 0, "bad-request"), (0, 10, "empty-prompt")])
def test_lengths_beyond_the_model_are_400(prompt, max_tokens, reason):
    with pytest.raises(RouteError) as e:
        decide(make_cfg(), prompt, max_tokens)
    assert (e.value.status, e.value.reason) == (400, reason)


def test_models_unknown_and_required():
    cfg = make_cfg()
    assert decide(cfg, 10, 10, model="m").model == "m"
    with pytest.raises(RouteError) as e:
        decide(cfg, 10, 10, model="gpt-4")
    assert (e.value.status, e.value.reason) == (404, "unknown-model")
    two = make_cfg(engines={"a": {"model_id": "m1", "max_model_len": 4096}, "b": {"model_id": "m2", "max_model_len": 4096}},
                   tiers=[{"name": "x", "engine": "a"}, {"name": "y", "engine": "b", "budget": 256}], tenants={},
                   server={"auth": "open"})
    with pytest.raises(RouteError) as e:
        decide(two, 10, 10, allowed={"x", "y"})
    assert e.value.reason == "model-required"
    assert decide(two, 10, 10, model="m2", allowed={"x", "y"}).tier.name == "y"


def test_kv_bound_matches_the_engine_schedule():
    cfg = make_cfg()
    req = RequestShape(100, 2000)
    eng = cfg.engines["cpu"]
    assert kv_bound(cfg.tier("full"), req, eng) == 2100
    assert kv_bound(cfg.tier("small"), req, eng) == 256 + 128
    assert kv_bound(cfg.tier("small"), RequestShape(100, 50), eng) == 150


# -- KV pressure -----------------------------------------------------------------------------------------
HOT = {"cpu": EngineLoad(kv_usage=0.95, waiting=0)}


def test_pressure_falls_back_to_a_smaller_budget():
    cfg = make_cfg()
    d = decide(cfg, prompt=129, max_tokens=2000, loads=HOT)             # big by the trace-share rule
    assert (d.tier.name, d.reason) == ("small", "pressure-fallback")   # small still holds the prompt
    d = decide(cfg, prompt=600, max_tokens=3000, loads=HOT)             # full: no compressed tier leaves room
    assert (d.tier.name, d.reason) == ("big", "pressure-fallback")
    assert "lab" not in {decide(cfg, 600, 3000, loads=HOT).tier.name}  # explicit-only tiers stay explicit
    d = decide(cfg, prompt=300, max_tokens=3000, loads=HOT)             # big; small cannot hold 300 tokens
    assert (d.tier.name, d.reason) == ("big", "pressure-queued")
    d = decide(cfg, prompt=20, max_tokens=200, loads=HOT)               # short: no tier would hold less
    assert (d.tier.name, d.reason) == ("full", "pressure-queued")
    d = decide(cfg, prompt=20, max_tokens=3000, loads={"cpu": EngineLoad(kv_usage=0.1, waiting=9)})
    assert (d.tier.name, d.reason) == ("small", "pressure-queued")      # queue depth counts; already smallest
    d = decide(cfg, prompt=129, max_tokens=2000, loads={"cpu": EngineLoad(kv_usage=0.5, waiting=1)})
    assert (d.tier.name, d.reason) == ("big", "long-prompt")            # below both thresholds


def test_pressure_is_ignored_for_explicit_tiers_and_in_queue_mode():
    assert decide(make_cfg(), 20, 3000, tier="big", loads=HOT).reason == "explicit"
    d = decide(make_cfg(routing={"on_pressure": "queue", "rule": "cheapest-fit"}), 600, 3000, loads=HOT)
    assert (d.tier.name, d.reason) == ("full", "pressure-queued")


def test_pressure_fallback_across_engines():
    cfg = make_cfg(
        engines={"a": {"model_id": "m", "max_model_len": 4096}, "b": {"model_id": "m", "max_model_len": 4096}},
        tiers=[{"name": "full", "engine": "a"}, {"name": "k1", "engine": "b", "budget": 1024},
               {"name": "k2", "engine": "b", "budget": 512}], tenants={}, server={"auth": "open"})
    tiers = {"full", "k1", "k2"}
    hot = EngineLoad(kv_usage=0.99)
    d = decide(cfg, 600, 3000, allowed=tiers, loads={"a": hot})
    assert (d.tier.name, d.reason) == ("k1", "pressure-fallback")
    d = decide(cfg, 600, 3000, allowed=tiers, loads={"a": hot, "b": hot})     # the other engine is hot too
    assert (d.tier.name, d.reason) == ("full", "pressure-queued")
    d = decide(cfg, 300, 700, allowed={"full", "k1"}, loads={"a": hot})      # short: k1 would hold as much
    assert (d.tier.name, d.reason) == ("full", "pressure-queued")
    assert decide(cfg, 20, 900, allowed=tiers, loads={"a": hot}).reason == "cheapest-fit"


def test_engine_load_aggregates_every_replica():
    """The router polls every replica of an engine deployment; the pressure rule reads the aggregate."""
    a = {"running": 3, "waiting": 0, "free_blocks": 10, "total_blocks": 100, "in_flight": 3, "block_size": 128}
    b = {"running": 8, "waiting": 6, "free_blocks": 2, "total_blocks": 100, "in_flight": 14, "block_size": 128}
    agg = aggregate_loads({"r1": a, "r2": b})
    assert agg["replicas"] == 2 and agg["running"] == 11 and agg["waiting"] == 6 and agg["in_flight"] == 17
    assert (agg["free_blocks"], agg["total_blocks"]) == (12, 200) and agg["kv_usage"] == pytest.approx(0.94)
    load = engine_load(agg)
    assert load.waiting == 3 and load.pressured(make_cfg().engines["cpu"].pressure)   # 0.94 >= 0.8
    cool = engine_load(aggregate_loads({"r1": {**a, "free_blocks": 90}, "r2": {**b, "free_blocks": 50, "waiting": 6}}))
    assert cool.kv_usage == pytest.approx(0.3) and not cool.pressured(make_cfg().engines["cpu"].pressure)  # 3 < 4
    assert engine_load(aggregate_loads({"r1": a})).kv_usage == pytest.approx(0.9)      # one replica: its own
    assert aggregate_loads({})["kv_usage"] == 0.0


# -- CLI (no Ray started) ----------------------------------------------------------------------------------
def test_serve_cli_rejects_a_bad_config_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: {cpu: {max_model_len: 64}}\ntiers: [{name: x, engine: gpu}]\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown engine" in result.output


def test_example_request_is_a_valid_openai_chat_call():
    import json
    import shlex

    from kvtier.service.serve_cli import example_request

    cmd = shlex.split(example_request("http://127.0.0.1:8000", "tiny-qwen3", "$KEY"))
    body = json.loads(cmd[cmd.index("-d") + 1])
    assert cmd[3].endswith("/v1/chat/completions") and body["model"] == "tiny-qwen3" and body["messages"]
    assert "Authorization: Bearer $KEY" in cmd


# -- max_num_seqs: auto ----------------------------------------------------------------------------------
def test_auto_max_num_seqs_fills_the_pool_with_the_smallest_tiers_bound(monkeypatch):
    monkeypatch.setattr("kvtier.engine.cpu_dtype.cpu_flags", lambda: {"avx2", "amx_bf16"})  # dtype auto: the model's
    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.service.sizing import auto_max_num_seqs, kv_bytes_per_token, resolved_engine_kwargs

    path = str(ensure_tiny_model())
    assert kv_bytes_per_token(path) == 4 * 2 * 64 * 2 * 2          # layers * KV heads * head_dim * (K, V) * bf16
    local = load_config(CONFIGS / "local.yaml")
    assert local.engines["cpu"].engine_kwargs["max_num_seqs"] == "auto"
    kwargs, why = resolved_engine_kwargs(local, "cpu", path)
    # 64 MiB / 256 KiB per 128-token block = 256 blocks; k128 (r=32): prompt <= 64 + 128 + 64 = 2 blocks
    assert kwargs["max_num_seqs"] == 128 and "256 blocks" in why and kwargs["enforce_eager"] is True
    # the smallest *auto* compressed tier decides; `lab` (explicit only) does not
    cfg = make_cfg(engines={"cpu": {"model": "tiny", "max_model_len": 4096, "kv_cache_bytes": "64MiB",
                                    "engine_kwargs": {"max_num_seqs": "auto"}}})
    # small: K=256 r=64 -> 128 + 256 + 128 = 512 tokens = 4 blocks -> 64
    assert auto_max_num_seqs(cfg, "cpu", path)[0] == 64
    assert resolved_engine_kwargs(cfg, "cpu", path)[0]["max_num_seqs"] == 64
    # float32: 4 bytes per KV value, half the blocks in the same bytes -> 32
    cfg.engines["cpu"].engine_kwargs["dtype"] = "float32"
    assert auto_max_num_seqs(cfg, "cpu", path)[0] == 32 and "128 blocks" in auto_max_num_seqs(cfg, "cpu", path)[1]
    # no fixed pool: vLLM's default; a number is left alone
    cfg = make_cfg(engines={"cpu": {"model": "tiny", "max_model_len": 4096, "engine_kwargs": {"max_num_seqs": "auto"}}})
    assert "max_num_seqs" not in resolved_engine_kwargs(cfg, "cpu", path)[0]
    cfg = make_cfg(engines={"cpu": {"model": "tiny", "max_model_len": 4096, "kv_cache_bytes": "8GiB",
                                    "engine_kwargs": {"max_num_seqs": 16}}})
    assert resolved_engine_kwargs(cfg, "cpu", path) == ({"max_num_seqs": 16}, None)
    cfg = make_cfg(engines={"cpu": {"model": "tiny", "max_model_len": 4096, "kv_cache_bytes": "8GiB",
                                    "engine_kwargs": {"max_num_seqs": "auto"}}})
    assert auto_max_num_seqs(cfg, "cpu", path)[0] == 256                 # capped at vLLM's GPU default


@pytest.mark.parametrize("flags, accelerator, given, want", [
    ({"avx2", "avx512f"}, "cpu", None, "float32"),            # no native bf16: auto is float32
    ({"avx2", "avx512f"}, "cpu", "auto", "float32"),
    ({"avx2", "avx512f"}, "cpu", "bfloat16", "bfloat16"),     # an explicit choice is kept (and warned about)
    ({"avx2", "amx_bf16"}, "cpu", None, None),                # native: the model's own dtype
    ({"avx2", "avx512_bf16"}, "cpu", "auto", None),
    ({"avx2"}, "gpu", None, None),
    (set(), "cpu", None, None),                               # no /proc/cpuinfo: nothing to tell, vLLM's auto
])
def test_dtype_auto_resolves_by_the_cpu(monkeypatch, flags, accelerator, given, want):
    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.service.sizing import resolved_engine_kwargs

    monkeypatch.setattr("kvtier.engine.cpu_dtype.cpu_flags", lambda: flags)
    kwargs = {"max_num_seqs": "auto"} | ({"dtype": given} if given else {})
    eng = {"model": "tiny", "max_model_len": 4096, "kv_cache_bytes": "64MiB", "accelerator": accelerator,
           "engine_kwargs": kwargs}
    got, why = resolved_engine_kwargs(make_cfg(engines={"cpu": eng}), "cpu", str(ensure_tiny_model()))
    assert got.get("dtype") == want and got.get("dtype") != "auto"
    assert ("dtype auto = float32" in (why or "")) == (want == "float32" and given != "bfloat16")
    if accelerator == "cpu":      # the batch limit is sized in the resolved dtype: float32 holds half the blocks
        assert got["max_num_seqs"] == (32 if want == "float32" else 64)


# -- stream coalescing (engine_server.coalesce) ------------------------------------------------------------
def test_coalesce_sends_the_first_chunk_at_once_then_batches_per_interval():
    import asyncio

    pytest.importorskip("ray.llm")
    from kvtier.service.engine_server import coalesce

    async def engine(n, gap_s, fail_at=None):
        for i in range(n):
            if i == fail_at:
                raise ValueError("engine said no")
            yield [f"c{i}"]          # Ray Serve LLM's own batcher (interval 0) wraps each chunk in a list
            await asyncio.sleep(gap_s)

    async def collect(stream):
        loop, out = asyncio.get_running_loop(), []
        t0 = loop.time()
        async for batch in stream:
            out.append((round(loop.time() - t0, 2), batch))
        return out

    got = asyncio.run(collect(coalesce(engine(12, 0.01), 0.05)))
    assert got[0] == (0.0, ["c0"])                                   # TTFT is the engine's
    assert [c for _, b in got for c in b] == [f"c{i}" for i in range(12)]   # nothing lost, order kept
    assert 2 <= len(got) < 12                                        # batched (~0.12 s of chunks at 0.05 s)
    middle = got[1:-1]                                                # the last batch leaves at the end
    assert all(b - a >= 0.04 for (a, _), (b, _) in zip(middle, middle[1:]))
    # the end of the stream does not wait out the interval: the last tokens leave at once
    got = asyncio.run(collect(coalesce(engine(3, 0.01), 1.0)))
    assert [b for _, b in got] == [["c0"], ["c1", "c2"]] and got[-1][0] < 0.9
    # an engine error arrives after the chunks before it
    async def failing():
        out = []
        try:
            async for batch in coalesce(engine(5, 0.0, fail_at=3), 0.05):
                out += batch
        except ValueError as exc:
            return out, str(exc)
    assert asyncio.run(failing()) == (["c0", "c1", "c2"], "engine said no")


def test_a_stream_that_opens_with_an_error_event_becomes_the_callers_error():
    """vLLM reports an input error it finds once generating as the stream's first SSE event; the engine
    server turns exactly that (one error event, [DONE] or not) into an error body the router answers 4xx."""
    pytest.importorskip("ray.llm")
    from kvtier.service.engine_server import _sse_error

    event = 'data: {"error": {"message": "Token id 9 is out of vocabulary", "type": "BadRequestError", "code": 400}}\n\n'
    want = {"error": {"message": "Token id 9 is out of vocabulary", "type": "BadRequestError", "code": 400}}
    assert _sse_error(event) == want and _sse_error(event + "data: [DONE]\n\n") == want
    assert _sse_error('data: {"id": "c", "choices": [{"text": "x"}]}\n\n') is None      # a token
    assert _sse_error(event + 'data: {"id": "c"}\n\n') is None                          # not only the error
    assert _sse_error('data: {"error": oops}\n\n') is None and _sse_error({"response": {}}) is None


def test_counters_are_pulled_from_the_worker_only_after_engine_steps(monkeypatch):
    """The load poll pushes kvtier's worker counters to Ray metrics at most every EXPORT_EVERY_S, and not at
    all while the engine takes no step: each pull is a collective RPC that wakes the worker's busy loop."""
    import asyncio

    pytest.importorskip("ray.llm")
    from kvtier.service import engine_server

    class Engine:
        steps = 3

        def load(self):
            return {"steps": self.steps, "running": 0}

    class Exporter:
        loads = 0

        def update_load(self, load):
            self.loads += 1

    pulls, exporter = [], Exporter()
    server = object.__new__(engine_server.KVTierLLMServer)
    server.engine, server._replica, server._exporter = Engine(), "r0", exporter

    async def pull(exp):
        pulls.append(server.engine.steps)
    monkeypatch.setattr(server, "_export_counters", pull)
    monkeypatch.setattr(engine_server, "EXPORT_EVERY_S", 0.0)

    async def polls(n):
        for _ in range(n):
            await server.kvtier_load()
            await asyncio.sleep(0)
    asyncio.run(polls(3))
    assert pulls == [3] and exporter.loads == 3      # gauges on every poll, one pull for the steps seen
    server.engine.steps = 5
    asyncio.run(polls(2))
    assert pulls == [3, 5]


def test_serve_health_check_fails_on_an_errored_engine():
    """Serve replaces a replica whose `check_health` raises: it does when the vLLM client reports `errored`
    (the flag kvtier_load gives the router) even where vLLM's own check passes, and the load reports the
    same flag. No Ray, no engine: the objects are built without __init__."""
    import asyncio

    pytest.importorskip("ray.llm")
    from kvtier.service import engine_server

    class Client:           # vLLM's AsyncLLM as the replica sees it
        errored = False
        checks = 0

        async def check_health(self):
            self.checks += 1   # passes whatever `errored` says: kvtier's check must not rely on it

    engine = object.__new__(engine_server.KVTierVLLMEngine)
    engine._engine_client = Client()
    server = object.__new__(engine_server.KVTierLLMServer)
    server.engine = engine
    asyncio.run(server.check_health())
    engine._engine_client.errored = True
    with pytest.raises(RuntimeError, match="errored"):
        asyncio.run(server.check_health())
    assert engine._engine_client.checks == 2 and engine.errored is True
    assert object.__new__(engine_server.KVTierVLLMEngine).errored is False   # not started yet: healthy
    server.engine = None                                                       # LLMServer before start()
    asyncio.run(server.check_health())


def test_a_prompt_the_tokenizer_cannot_encode_is_a_value_error():
    """The router answers ValueError with a 400 (router.py); the reasoner's character-level tokenizer
    raises a bare Exception for text outside its alphabet, which must not become a 500."""
    from kvtier.models.reasoner import REASONER_EVICT_DIR
    from kvtier.service.tokens import PromptCounter

    counter = PromptCounter(str(REASONER_EVICT_DIR))
    assert counter.completion("y=37 x=05 n=100 ?x\n") == 20
    with pytest.raises(ValueError, match="UNK"):
        counter.completion("hello")


# -- routing.rule: headroom (the default) --------------------------------------------------------------------
def headroom_cfg(elastic=True):
    tiers = [{"name": "full", "engine": "cpu", "budget": "full"},
             {"name": "small", "engine": "cpu", "budget": 256, "buffer": 64},
             {"name": "big", "engine": "cpu", "budget": 1024, "buffer": 64}]
    if elastic:
        tiers.append({"name": "elastic", "engine": "cpu", "budget": "elastic", "floor": 256, "buffer": 64})
    return make_cfg(tiers=tiers, tenants={}, server={"auth": "open"}, routing={"min_trace_share": 0.5})


def free(blocks, waiting=0):
    return {"cpu": EngineLoad(kv_usage=0.5, waiting=waiting, free_blocks=blocks, block_size=128)}


def test_headroom_is_the_default_rule():
    assert parse_config({"engines": {"e": {"max_model_len": 64}}, "tiers": [{"name": "f", "engine": "e"}],
                         "server": {"auth": "open"}}).routing.rule == "headroom"


@pytest.mark.parametrize("free_blocks, waiting, want", [
    (None, 0, ("full", "headroom")),            # before the first poll: idle is assumed
    (1000, 0, ("full", "headroom")),            # idle: full attention (prompt 100 + 3000 = 25 blocks)
    (25, 0, ("full", "headroom")),              # exactly fits
    (24, 0, ("big", "headroom")),               # filling: K=1024 + 2r = 1152 -> 9 blocks
    (9, 0, ("big", "headroom")),
    (8, 0, ("small", "headroom")),              # K=256 + 2r = 384 -> 3 blocks
    (2, 0, ("elastic", "headroom-floor")),      # nothing fits: the elastic tier's floor
    (1000, 1, ("elastic", "headroom-floor")),   # the engine already queues: nothing "fits"
])
def test_headroom_takes_the_largest_budget_that_fits(free_blocks, waiting, want):
    d = route(headroom_cfg(), RequestShape(100, 3000), {"full", "small", "big", "elastic"},
              free(free_blocks, waiting) if free_blocks is not None else None)
    assert (d.tier.name, d.reason) == want
    assert str(free_blocks) in d.detail or free_blocks is None or d.reason == "headroom-floor"


def test_headroom_without_an_elastic_tier_queues_on_the_smallest_budget():
    d = route(headroom_cfg(elastic=False), RequestShape(100, 3000), {"full", "small", "big"}, free(2))
    assert (d.tier.name, d.reason) == ("small", "headroom-queued")


def test_headroom_respects_the_trace_share_and_the_tenant():
    cfg = headroom_cfg()
    # a 200-token prompt leaves under half of K=256 (and of the floor): big when it fits, else queued on big
    assert route(cfg, RequestShape(200, 3000), {"full", "small", "big", "elastic"}, free(9)).tier.name == "big"
    d = route(cfg, RequestShape(200, 3000), {"full", "small", "big", "elastic"}, free(2))
    assert (d.tier.name, d.reason) == ("big", "headroom-queued")
    d = route(cfg, RequestShape(200, 3000), {"full", "small", "elastic"}, free(2))
    assert (d.tier.name, d.reason) == ("full", "headroom-queued")
    # a tenant without full attention gets the largest budget it may use
    assert route(cfg, RequestShape(100, 3000), {"small", "elastic"}, free(1000)).tier.name == "small"


def test_elastic_tier_spec_and_refusals():
    t = headroom_cfg().tier("elastic")
    assert (t.compressed, t.elastic, t.bound_budget) == (False, True, 256)
    assert t.extra_args() == {"kvtier_budget": "elastic", "kvtier_floor": 256, "kvtier_policy": "random",
                              "kvtier_buffer": 64}
    base = {"name": "e", "engine": "cpu"}
    for tier, field in [({"budget": "elastic"}, "floor"), ({"budget": 512, "floor": 256}, "floor"),
                        ({"budget": "elastic", "floor": 256, "policy": "rkv"}, "rkv"),
                        ({"budget": "elastic", "floor": 4096}, "floor 4096"),
                        ({"budget": "elastic", "floor": 16, "sinks": 32}, "floor 16")]:
        with pytest.raises(ConfigError, match=field):
            make_cfg(tiers=[{"name": "full", "engine": "cpu"}, {**base, **tier}])


def test_router_debits_what_it_routed_until_the_next_poll():
    from kvtier.service.engine_health import EngineHealth

    cfg = headroom_cfg()
    health = EngineHealth(cfg, {})
    health.loads["cpu"] = free(30)["cpu"]
    allowed = {"full", "small", "big", "elastic"}
    got = []
    for _ in range(4):      # a burst between two polls: each decision sees the blocks the earlier ones took
        d = route(cfg, RequestShape(100, 3000), allowed, health.routing_loads())
        health.debit(d, cfg)
        got.append(d.tier.name)
    assert got == ["full", "small", "elastic", "elastic"]      # 30 - 25 = 5 -> small (3) -> 2 left
    health.loads["cpu"] = free(30)["cpu"]                      # a fresh poll: the debits are spent
    health.on_polled("cpu")
    assert route(cfg, RequestShape(100, 3000), allowed, health.routing_loads()).tier.name == "full"


# -- the replica with the most free KV (replica_router.py, Serve's request-router extension point) ---------
def test_generations_go_to_the_replica_with_the_most_free_kv():
    from types import SimpleNamespace as NS

    from kvtier.service.replica_router import rank_by_free_kv

    a, b, c, new = (NS(name=n, routing_stats=s) for n, s in
                    [("a", {"free_blocks": 3}), ("b", {"free_blocks": 40}), ("c", {"free_blocks": 12}), ("new", {})])
    names = lambda ranks: [[r.name for r in rank] for rank in ranks]  # noqa: E731
    assert names(rank_by_free_kv([a, b, c], "kvtier_generate")) == [["b"], ["c"], ["a"]]
    assert names(rank_by_free_kv([a, b, new], "kvtier_generate"))[0] == ["new"]    # not reported yet: room
    assert names(rank_by_free_kv([a, b, c], "kvtier_load")) == [["a", "b", "c"]]    # polls reach every replica
    assert names(rank_by_free_kv([a], "kvtier_generate")) == [["a"]]


def test_engine_deployments_use_the_free_kv_router():
    from kvtier.service.app import llm_config

    cfg = load_config(CONFIGS / "local.yaml")
    llm = llm_config("cpu", cfg.engines["cpu"], "m", "/nonexistent/model")
    router = llm.deployment_config["request_router_config"]
    assert router["request_router_class"] == "kvtier.service.replica_router:MostFreeKVRouter"
    from ray.serve.config import RequestRouterConfig

    RequestRouterConfig(**router)            # Serve accepts it
