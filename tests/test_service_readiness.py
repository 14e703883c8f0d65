"""Per-pod readiness and the bootstrap order (issue #61 items 1 and 2), at the unit level: one errored engine
replica of three leaves its engine serving (routing, the router's health, Serve's replica ranking) and takes
only its own pod out of the Service (pod_ready.py); replicas wait, bounded, for their model files
(weights.py) and keep their gauges and heartbeat fresh on their own (engine_upkeep.py). No Ray, no vLLM."""

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import pytest

from kvtier.service import pod_ready
from kvtier.service.config import parse_config
from kvtier.service.engine_health import EngineHealth
from kvtier.service.pod_ready import ERRORED, SERVING, Heartbeat, check
from kvtier.service.replica_router import rank_by_free_kv
from kvtier.service.routing import aggregate_loads
from kvtier.service.weights import ModelFilesMissing, wait_for_model

CFG = parse_config({"engines": {"cpu": {"model": "tiny", "max_model_len": 4096, "deployment": {"num_replicas": 3}}},
                    "tiers": [{"name": "full", "engine": "cpu"}], "server": {"auth": "open", "load_poll_s": 0.01}})


def replica(rid, errored=False, free=50):
    return {"replica": rid, "running": 1, "waiting": 0, "free_blocks": free, "total_blocks": 100, "block_size": 16,
            "errored": errored, "node_id": f"node-{rid}"}


def test_one_errored_replica_of_three_leaves_the_engine_serving():
    agg = aggregate_loads({"a": replica("a"), "b": replica("b", errored=True, free=100), "c": replica("c")})
    assert agg["errored"] is False and agg["errored_replicas"] == 1
    assert (agg["replicas"], agg["free_blocks"], agg["total_blocks"]) == (2, 100, 200)   # its pool left out
    every = aggregate_loads({r: replica(r, errored=True) for r in "abc"})
    assert every["errored"] is True and every["errored_replicas"] == 3


class Handle:
    """An engine deployment's handle: each kvtier_load call answers the next replica's load."""

    def __init__(self, loads):
        self.loads, self.i = loads, 0
        self.kvtier_load = self

    def remote(self):
        load = self.loads[self.i % len(self.loads)]
        self.i += 1
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(dict(load))
        return fut


@pytest.mark.parametrize("errored, healthy", [({"b"}, True), ({"a", "b", "c"}, False)])
def test_the_router_marks_an_engine_unhealthy_only_when_no_replica_can_serve(errored, healthy):
    health = EngineHealth(CFG, {"cpu": Handle([replica(r, errored=r in errored) for r in "abc"])})
    asyncio.run(health.poll_once("cpu"))
    state = health.state["cpu"]
    assert state["healthy"] is healthy and state["errored_replicas"] == len(errored)
    assert ("cpu" in health.loads) and not health.down["cpu"].is_set()   # requests are not turned away


def test_generations_skip_an_errored_replica_until_serve_replaces_it():
    a, b, c = (NS(name=n, routing_stats={"free_blocks": f, "errored": e})
               for n, f, e in [("a", 10, False), ("b", 90, True), ("c", 20, False)])
    assert [r[0].name for r in rank_by_free_kv([a, b, c], "kvtier_generate")] == ["c", "a", "b"]


# -- pod readiness ----------------------------------------------------------------------------------------
def test_one_failed_replica_takes_only_its_own_pod_out(tmp_path):
    pods = {p: tmp_path / p for p in ("gpu-0", "gpu-1", "gpu-2")}
    for i, (pod, d) in enumerate(pods.items()):
        Heartbeat("engine-shared", f"r{i}", d).beat(ERRORED if pod == "gpu-1" else SERVING)
    Heartbeat("KVTierRouter", "x", pods["gpu-0"]).beat(SERVING)
    verdict = {pod: check(d) for pod, d in pods.items()}
    assert verdict["gpu-0"] == [] and verdict["gpu-2"] == []
    assert verdict["gpu-1"] == ["engine-shared replica r1: errored (its engine failed)"]
    # a stuck replica (its event loop no longer refreshes the file) takes its pod out after stale_s
    assert check(pods["gpu-0"], stale_s=30, now=time.time() + 31)[0].endswith("s")
    # a replica that is gone (replaced) is forgotten, its file removed
    assert check(pods["gpu-1"], alive=lambda pid: False) == [] and not list(pods["gpu-1"].glob("*.json"))
    assert check(tmp_path / "no-replica-yet") == []     # a pod whose replicas still start: its proxy serves


def test_the_probe_command_exits_by_this_pods_replicas(tmp_path):
    """What the readiness probe runs (k8s/base/rayservice.yaml), in well under its timeout."""
    env = {**os.environ, pod_ready.DIR_ENV: str(tmp_path)}
    cmd = [sys.executable, "-m", "kvtier.service.pod_ready"]
    Heartbeat("engine-shared", "r0", tmp_path).beat(SERVING)
    t0 = time.time()
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert time.time() - t0 < 5
    Heartbeat("engine-shared", "r0", tmp_path).beat(ERRORED, "its vLLM engine has failed")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "engine-shared replica r0: errored" in out.stderr


def test_engine_upkeep_refreshes_gauges_and_heartbeat_without_a_router(tmp_path):
    from kvtier.service import engine_upkeep

    load = {"free_blocks": 7, "total_blocks": 10, "running": 2, "waiting": 1, "errored": False}
    seen = []
    server = NS(engine=NS(load=lambda: dict(load)), _metrics_exporter=lambda: NS(update_load=seen.append))
    hb = Heartbeat("engine-cpu", "r0", tmp_path)
    engine_upkeep.tick(server, hb)
    assert seen == [load] and check(tmp_path) == []
    load["errored"] = True
    engine_upkeep.tick(server, hb)
    assert len(seen) == 2 and "errored" in check(tmp_path)[0]
    assert engine_upkeep.tick(NS(engine=None), hb) is None      # before the engine exists: nothing


# -- waiting for the weights --------------------------------------------------------------------------------
def test_replicas_wait_for_the_model_files_and_report_it(tmp_path, caplog):
    model = tmp_path / "Qwen3-8B"
    reports = []

    async def fill_later():
        await asyncio.sleep(0.3)
        model.mkdir()
        (model / ".kvtier-complete").write_text("")

    async def run():
        filler = asyncio.ensure_future(fill_later())
        waited = await wait_for_model(str(model), ".kvtier-complete", 10, "engine replica of engine-shared",
                                      report=reports.append, poll_s=0.05)
        await filler
        return waited

    caplog.set_level("WARNING", logger="kvtier.service")
    waited = asyncio.run(run())
    assert 0.25 < waited < 5 and reports[-1] == 0.0 and max(reports) > 0.2
    assert "waiting for the model files" in caplog.text and ".kvtier-complete is missing" in caplog.text


def test_the_wait_is_bounded_and_skipped_where_nothing_is_local(tmp_path):
    reports = []
    with pytest.raises(ModelFilesMissing, match="did not appear within server.model_wait_s=0.2 s"):
        asyncio.run(wait_for_model(str(tmp_path / "none"), "config.json", 0.2, "router", reports.append, poll_s=0.05))
    assert reports and reports[-1] >= 0.2
    assert asyncio.run(wait_for_model("Qwen/Qwen3-8B", "config.json", 60, "x")) == 0.0     # a hub id
    assert asyncio.run(wait_for_model(str(tmp_path / "none"), "config.json", 0, "x")) == 0.0   # no wait configured


def test_engine_replicas_get_the_wait_settings_and_routers_their_placement():
    from kvtier.service.app import llm_config

    cfg = parse_config({**CFG.model_dump(mode="json"),
                        "server": {"auth": "open", "model_wait_s": 600, "model_ready_file": ".kvtier-complete",
                                   "router_resources": {"kvtier_router": 1}}})
    llm = llm_config("cpu", cfg.engines["cpu"], "m", "/models/x", model_wait_s=cfg.server.model_wait_s,
                     model_ready_file=cfg.server.model_ready_file)
    assert llm.experimental_configs["kvtier_model_wait_s"] == 600
    assert llm.experimental_configs["kvtier_model_ready_file"] == ".kvtier-complete"
