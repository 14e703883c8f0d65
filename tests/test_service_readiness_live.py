"""One failed engine replica of three, on a live Ray Serve (issue #61 item 1): the real router
(KVTierRouter) in front of a stand-in engine deployment of three replicas (no vLLM: the replicas answer the
same calls as KVTierLLMServer), the third "pod" of each replica its own heartbeat folder. The replica whose
engine reports errored takes only its own pod out (pod_ready), the router keeps the engine healthy, Serve's
request router (replica_router.MostFreeKVRouter) sends nothing to it, and every request is served by the
other two. ~1 minute on a busy 2-core machine."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from service_helpers import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)
BAD = 1   # the slot of the replica whose engine has failed


def _fake_engine(root: str):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=3, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100,
                      request_router_config=RequestRouterConfig(
                          request_router_class="kvtier.service.replica_router:MostFreeKVRouter",
                          request_routing_stats_period_s=0.2, request_routing_stats_timeout_s=2.0))
    class FakeEngine:
        async def __init__(self, root: str):
            from kvtier.service.pod_ready import ERRORED, SERVING, Heartbeat, keep_beating

            for i in range(3):   # each replica takes a slot: its "pod"
                try:
                    os.close(os.open(f"{root}/slot-{i}", os.O_CREAT | os.O_EXCL))
                    self.slot = i
                    break
                except FileExistsError:
                    continue
            self.errored = self.slot == BAD
            beat = Heartbeat("engine-cpu", f"r{self.slot}", Path(root) / f"pod-{self.slot}")
            state = (ERRORED, "its vLLM engine has failed") if self.errored else (SERVING, "")
            self._beat = asyncio.get_running_loop().create_task(keep_beating(beat, lambda: state, every_s=0.2))

        def _free(self) -> int:
            return 900 if self.errored else 100   # the errored one looks roomiest: it must still rank last

        async def kvtier_load(self):
            return {"replica": f"r{self.slot}", "running": 0, "waiting": 0, "free_blocks": self._free(),
                    "total_blocks": 1000, "block_size": 16, "errored": self.errored, "node_id": f"pod-{self.slot}"}

        def record_routing_stats(self):
            return {"free_blocks": self._free(), "errored": self.errored}

        async def kvtier_generate(self, kind, payload):
            from kvtier.service.first_token import first_item

            received = time.time()
            if self.errored:
                yield first_item({"error": {"message": "EngineDeadError: engine is dead", "code": 500}}, received)
                return
            body = {"id": "cmpl-1", "object": "text_completion", "model": payload["model"], "system_fingerprint":
                    f"r{self.slot}", "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            yield first_item({"response": body}, received)

    return FakeEngine.bind(root)


def test_one_failed_engine_replica_leaves_the_other_pods_ready_and_serving(tmp_path):
    import httpx
    import ray
    from ray import serve

    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.service.pod_ready import DIR_ENV, check
    from kvtier.service.router import KVTierRouter

    cfg = {"engines": {"cpu": {"model": "tiny", "model_id": "m", "max_model_len": 4096,
                               "deployment": {"num_replicas": 3}}},
           "tiers": [{"name": "full", "engine": "cpu"}],
           "server": {"auth": "open", "load_poll_s": 0.2, "request_timeout_s": 30}}
    port = free_port()
    env = {DIR_ENV: str(tmp_path / "router-pod"), "TOKENIZERS_PARALLELISM": "false"}
    temp = f"/tmp/kvtier-rl-{os.getpid()}"     # short: Ray's socket paths must fit
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": env}, _temp_dir=temp)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        router = KVTierRouter.options(name="KVTierRouter").bind(cfg, {"cpu": _fake_engine(str(tmp_path))},
                                                                  {"cpu": str(ensure_tiny_model())})
        serve.run(router, name="kvtier", route_prefix="/")
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        deadline, stats = time.time() + 90, {}
        while time.time() < deadline:    # the router's polls have seen all three replicas
            stats = http.get("/v1/kvtier/stats").json()["engines"]["cpu"]
            if stats.get("errored_replicas") == 1 and stats.get("replicas") == 2:
                break
            time.sleep(0.5)
        time.sleep(1.0)                  # and Serve's request router has every replica's routing stats
        # the pods: only the failed replica's is not ready; the router's pod is
        pods = {i: check(tmp_path / f"pod-{i}") for i in range(3)}
        assert pods[BAD] == [f"engine-cpu replica r{BAD}: errored (its vLLM engine has failed)"], pods
        assert all(pods[i] == [] for i in range(3) if i != BAD), pods
        assert check(tmp_path / "router-pod") == [] and list((tmp_path / "router-pod").glob("KVTierRouter.*.json"))
        # the service: healthy, and every request served by the two good replicas
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert stats["healthy"] is True and stats["errored_replicas"] == 1 and stats["replicas"] == 2
        served = []
        for _ in range(12):
            r = http.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 1})
            assert r.status_code == 200, r.text
            served.append(r.json()["system_fingerprint"])
        assert f"r{BAD}" not in served and len(set(served)) >= 1
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
