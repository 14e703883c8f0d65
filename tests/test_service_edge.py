"""The service's edge (issue #61 item 3): API keys from a mounted Secret file, re-read on change without a
restart; the admin scope of /v1/kvtier/stats and the engines' errors; per-tenant rate limits answered with
OpenAI-shaped 429s. No Ray cluster and no vLLM: the router's FastAPI app runs with a stand-in replica."""

from types import SimpleNamespace

import pytest

from kvtier.service.auth import Authenticator, AuthError
from kvtier.service.config import ConfigError, parse_config
from kvtier.service.ratelimit import RateLimiter, retry_after


def make_cfg(tenants):
    return parse_config({
        "engines": {"cpu": {"model": "tiny", "model_id": "m", "max_model_len": 4096}},
        "tiers": [{"name": "full", "engine": "cpu"}, {"name": "small", "engine": "cpu", "budget": 256}],
        "tenants": tenants,
    })


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


# -- keys from a file, reloaded ----------------------------------------------------------------------------
def _secret_mount(tmp_path, name, value, generation):
    """A Kubernetes Secret volume: KEY -> ..data/KEY, ..data -> a timestamped folder swapped atomically."""
    folder = tmp_path / f"..{generation}"
    folder.mkdir()
    (folder / name).write_text(value)
    link = tmp_path / "..data"
    tmp_link = tmp_path / "..data_tmp"
    tmp_link.symlink_to(folder.name)
    tmp_link.replace(link)
    if not (tmp_path / name).is_symlink():
        (tmp_path / name).symlink_to(f"..data/{name}")
    return tmp_path / name


def test_keys_from_a_mounted_secret_file_are_reloaded_on_rotation(tmp_path):
    path = _secret_mount(tmp_path, "KVTIER_KEYS_APPS", "sk-old1,sk-old2\n", 1)
    clock = Clock()
    auth = Authenticator(make_cfg({"apps": {"api_keys_file": str(path)}}), reload_s=5, clock=clock)
    assert auth.tenant("Bearer sk-old2").name == "apps"
    _secret_mount(tmp_path, "KVTIER_KEYS_APPS", "sk-new\n", 2)        # the kubelet's atomic swap
    assert auth.tenant("Bearer sk-old1").name == "apps"               # not looked at again before reload_s
    clock.t += 5
    assert auth.tenant("Bearer sk-new").name == "apps"                # rotated, no restart
    with pytest.raises(AuthError, match="invalid API key"):
        auth.tenant("Bearer sk-old1")                                 # the old key is gone
    (tmp_path / "..data").unlink()                                    # the Secret's key removed: revoked
    clock.t += 5
    with pytest.raises(AuthError, match="invalid API key"):
        auth.tenant("Bearer sk-new")


def test_a_missing_or_empty_key_file_fails_the_start_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"tenant 'apps': api_keys_file .*KEYS cannot be read"):
        Authenticator(make_cfg({"apps": {"api_keys_file": str(tmp_path / "KEYS")}}))
    (tmp_path / "KEYS").write_text(" ,\n")
    with pytest.raises(ConfigError, match="holds no key"):
        Authenticator(make_cfg({"apps": {"api_keys_file": str(tmp_path / "KEYS")}}))
    with pytest.raises(ConfigError, match="not both"):
        make_cfg({"apps": {"api_keys_file": "/x", "api_keys_env": "X"}})


# -- rate limits -------------------------------------------------------------------------------------------
def test_token_bucket_per_tenant():
    clock = Clock()
    lim = RateLimiter(make_cfg({"a": {"api_keys": ["ka"], "rate_limit": {"requests_per_s": 2, "burst": 3}},
                                "b": {"api_keys": ["kb"]}}), clock=clock)
    assert [lim.wait("a") for _ in range(3)] == [None, None, None]    # the burst
    assert lim.wait("a") == pytest.approx(0.5)                        # then 2 per second
    clock.t += 0.5
    assert lim.wait("a") is None and lim.wait("a") == pytest.approx(0.5)
    assert all(lim.wait("b") is None for _ in range(100))             # no limit configured
    assert retry_after(0.2) == "1" and retry_after(1.5) == "2"


# -- over HTTP: the router's app with a stand-in replica -----------------------------------------------------
@pytest.fixture
def router_http(monkeypatch):
    pytest.importorskip("ray.serve")
    from fastapi.testclient import TestClient
    from ray import serve

    from kvtier.service import router
    from kvtier.service.metrics import RouterMetrics

    def make(cfg):
        replica = router.KVTierRouter.func_or_class.__new__(router.KVTierRouter.func_or_class)
        replica.cfg, replica.auth, replica.limits = cfg, Authenticator(cfg), RateLimiter(cfg)
        replica.metrics = RouterMetrics(export=False)
        replica.engines = {}

        class Counter:   # stands in for the tokenizer: answers 400, enough to tell a limited request apart
            def completion(self, prompt):
                raise ValueError("no tokenizer in this test")

        replica.counters = {"cpu": Counter()}
        replica.engine_health = SimpleNamespace(state={}, poll_once=None)
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=replica))
        return TestClient(router.app)

    return make


TENANTS = {"apps": {"api_keys": ["sk-apps"], "rate_limit": {"requests_per_s": 0.01, "burst": 2}},
           "ops": {"api_keys": ["sk-ops"], "tiers": [], "admin": True}}


def test_stats_need_an_admin_key(router_http):
    http = router_http(make_cfg(TENANTS))
    r = http.get("/v1/kvtier/stats", headers={"Authorization": "Bearer sk-apps"})
    assert r.status_code == 403 and r.headers["x-kvtier-reason"] == "admin-only"
    assert r.json()["error"]["type"] == "permission_error" and r.json()["error"]["code"] == "admin-only"
    assert http.get("/v1/kvtier/stats").status_code == 401
    r = http.get("/v1/kvtier/stats", headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code == 200 and set(r.json()) == {"router", "engines"}


def test_a_tenant_over_its_rate_gets_an_openai_shaped_429(router_http):
    http = router_http(make_cfg(TENANTS))
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    headers = {"Authorization": "Bearer sk-apps"}
    codes = []
    for _ in range(3):
        r = http.post("/v1/completions", json=body, headers=headers)
        codes.append(r.status_code)
    assert codes == [400, 400, 429]     # the burst of 2 passes the limiter (to the stand-in tokenizer's 400)
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate-limited" and "apps" in err["message"]
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-kvtier-reason"] == "rate-limited"
    r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code != 429                         # the limit is per tenant
