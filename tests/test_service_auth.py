"""Authentication fails closed (issue #41): `server.auth`, API keys -> tenants, the start-up check of the
tenants' variables (`kvtier serve`, the router replica) and what `/health` tells a caller without a key.
No Ray cluster and no vLLM: the router's FastAPI app runs with a stand-in for its replica."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.service.auth import OPEN_TENANT, Authenticator, AuthError
from kvtier.service.config import ConfigError, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "kvtier" / "configs"
TIERS = {"full", "small", "vip"}
KEYS_ENV = "KVTIER_TEST_TEAM_KEYS"


def make_cfg(tenants=None, **server):
    return parse_config({
        "engines": {"cpu": {"model": "tiny", "model_id": "m", "max_model_len": 4096}},
        "tiers": [{"name": "full", "engine": "cpu"}, {"name": "small", "engine": "cpu", "budget": 256},
                  {"name": "vip", "engine": "cpu", "budget": 1024,
                   "tenants": ["carol"] if "carol" in (tenants or {}) else "*"}],
        "tenants": tenants or {},
        "server": server,
    })


TENANTS = {"alice": {"api_keys": ["sk-a"], "tiers": ["full", "small"]}, "carol": {"api_keys_env": KEYS_ENV}}


# -- server.auth ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tenants", [None, {"ops": {"tiers": ["full"]}}], ids=["no-tenants", "tenant-without-keys"])
def test_keys_is_the_default_and_a_config_without_keys_is_refused(tenants):
    with pytest.raises(ConfigError, match=r"server\.auth 'keys'.*api_keys_env.*`server\.auth: open`"):
        make_cfg(tenants)


def test_open_mode_is_only_the_explicit_choice():
    cfg = make_cfg(auth="open")
    auth = Authenticator(cfg)
    assert cfg.open_mode and auth.open_mode
    assert auth.tenant(None).name == OPEN_TENANT and auth.tenant(None).tiers == TIERS
    assert auth.tenant("Bearer anything").name == OPEN_TENANT


def test_open_with_tenants_is_a_contradiction_refused_by_name():
    with pytest.raises(ConfigError, match=r"server\.auth 'open'.*\['alice', 'carol'\].*`server\.auth: keys`"):
        make_cfg(TENANTS, auth="open")


def test_keys_map_to_tenants_and_their_tiers(monkeypatch):
    monkeypatch.setenv(KEYS_ENV, "sk-c1, sk-c2")
    auth = Authenticator(make_cfg(TENANTS))
    assert not auth.open_mode
    assert auth.tenant("Bearer sk-a").tiers == {"full", "small"}
    assert auth.tenant("bearer sk-c2").tiers == TIERS
    for header in (None, "", "Basic sk-a", "Bearer", "Bearer sk-x"):
        with pytest.raises(AuthError):
            auth.tenant(header)


@pytest.mark.parametrize("value, why", [(None, "is not set"), ("", "holds no key"), (" , ", "holds no key")])
def test_an_unset_or_empty_keys_variable_is_a_start_up_error_naming_it(monkeypatch, value, why):
    """Parsing never reads the variables (configs are validated where they are absent); using the keys does."""
    if value is None:
        monkeypatch.delenv(KEYS_ENV, raising=False)
    else:
        monkeypatch.setenv(KEYS_ENV, value)
    cfg = make_cfg(TENANTS)
    assert not cfg.open_mode                       # never inferred from missing keys
    for start in (cfg.api_keys, lambda: Authenticator(cfg)):   # kvtier serve's check, the router replica's
        with pytest.raises(ConfigError, match=f"tenant 'carol': api_keys_env {KEYS_ENV} {why}"):
            start()


def test_shipped_configs_say_open_explicitly_or_need_keys(monkeypatch):
    for demo in ("local.yaml", "reasoner.yaml"):
        assert load_config(CONFIGS / demo).server.auth == "open"
    for var in ("KVTIER_KEYS_RESEARCH", "KVTIER_KEYS_APPS"):
        monkeypatch.delenv(var, raising=False)
    gpu = load_config(CONFIGS / "gpu.yaml")        # validates without its keys ...
    assert gpu.server.auth == "keys" and not gpu.open_mode
    with pytest.raises(ConfigError, match="KVTIER_KEYS_RESEARCH is not set"):
        gpu.api_keys()                             # ... and cannot start without them


# -- kvtier serve refuses before Ray starts ----------------------------------------------------------------
@pytest.fixture
def serve_cli(monkeypatch):
    """`kvtier serve --config FILE`; starting Ray is an assertion failure (the refusal comes first)."""
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.service import launch

    def no_start(*a, **k):
        raise AssertionError("kvtier serve started Ray")

    monkeypatch.setattr(launch, "start", no_start)
    monkeypatch.setattr(launch, "stop", lambda *a, **k: None)
    return lambda path: CliRunner().invoke(app, ["serve", "--config", str(path)])


@pytest.mark.parametrize("tenants, needle", [
    ("", "server.auth 'keys'"),
    (f"tenants: {{carol: {{api_keys_env: {KEYS_ENV}}}}}\n", f"tenant 'carol': api_keys_env {KEYS_ENV} is not set"),
], ids=["no-keys-configured", "keys-variable-unset"])
def test_kvtier_serve_refuses_to_start_without_keys(serve_cli, tmp_path, monkeypatch, tenants, needle):
    monkeypatch.delenv(KEYS_ENV, raising=False)
    cfg = tmp_path / "svc.yaml"
    cfg.write_text("engines: {cpu: {max_model_len: 4096}}\ntiers: [{name: full, engine: cpu}]\n" + tenants)
    result = serve_cli(cfg)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("kvtier serve: "), result.output
    assert needle in lines[0]


# -- /health -----------------------------------------------------------------------------------------------
@pytest.fixture
def router_http(monkeypatch):
    """The router's FastAPI app over HTTP, its replica a stand-in with the given config and engine state."""
    pytest.importorskip("ray.serve")
    from fastapi.testclient import TestClient
    from ray import serve

    from kvtier.service import router

    def make(cfg, state):
        replica = SimpleNamespace(auth=Authenticator(cfg), engine_health=SimpleNamespace(state=state))
        # Serve's class-based view hands each route the replica from the replica context
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=replica))
        return TestClient(router.app)

    return make


DOWN = {"cpu": {"healthy": False, "error": "ActorDiedError: replica at 10.0.0.7 died"}}
UP = {"cpu": {"healthy": True, "error": None}}


@pytest.mark.parametrize("state, code, status", [(UP, 200, "ok"), (DOWN, 503, "degraded")])
def test_health_tells_a_caller_without_a_key_liveness_only(router_http, monkeypatch, state, code, status):
    monkeypatch.setenv(KEYS_ENV, "sk-c1")
    http = router_http(make_cfg(TENANTS), state)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-a"}):
        r = http.get("/health", headers=headers)
        assert (r.status_code, r.json()) == (code, {"status": status}), headers
    r = http.get("/health", headers={"Authorization": "Bearer sk-c1"})      # a tenant's key, not an admin's
    assert (r.status_code, r.json()) == (code, {"status": status, "open_mode": False})
    http = router_http(make_cfg({**TENANTS, "ops": {"api_keys": ["sk-ops"], "tiers": [], "admin": True}}), state)
    r = http.get("/health", headers={"Authorization": "Bearer sk-ops"})     # the engines' errors: admins only
    assert (r.status_code, r.json()) == (code, {"status": status, "open_mode": False, "engines": state})


def test_health_in_open_mode_shows_the_detail_to_everyone(router_http):
    """Open mode holds no secret: every caller may use every tier and read /v1/kvtier/stats anyway."""
    r = router_http(make_cfg(auth="open"), DOWN).get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "degraded", "open_mode": True, "engines": DOWN})
