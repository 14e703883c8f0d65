"""The same app on a two-node Ray cluster on one machine: a head (no CPUs, so nothing heavy lands there)
and a worker with a `kvtier_engine` resource, started as separate `ray start` processes; `kvtier serve`
joins the cluster and the engine deployment is pinned to the worker by that resource."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")
pytest.importorskip("vllm")

from service_helpers import ServeProcess, free_port, service_env  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

RAY = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "ray")


def ray_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    exe = RAY if Path(RAY).exists() else shutil.which("ray")
    return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head and worker raylets as separate processes, in a temp dir of their own (no other Ray sees them)."""
    tmp = Path(f"/tmp/kvtier-mn-{uuid.uuid4().hex[:8]}")
    port = free_port()
    env = service_env()
    address = f"127.0.0.1:{port}"
    head = ray_cli("start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                   '--resources={"head": 1}', f"--temp-dir={tmp}", "--include-dashboard=false",
                   "--disable-usage-stats", env=env)
    assert head.returncode == 0, head.stdout + head.stderr
    try:
        worker = ray_cli("start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                         '--resources={"kvtier_engine": 1}', f"--temp-dir={tmp}", "--disable-usage-stats", env=env)
        assert worker.returncode == 0, worker.stdout + worker.stderr
        yield address, env
    finally:
        # `ray stop` would stop every Ray on the machine (other developers' too): stop only our raylets,
        # found by the temp dir they were started with.
        import psutil

        roots = [p for p in psutil.process_iter(["cmdline"]) if str(tmp) in " ".join(p.info["cmdline"] or [])]
        ours = {p.pid: p for p in roots}
        for root in roots:  # the raylets' agents and workers rename themselves (ray::...): take the trees
            try:
                ours.update({c.pid: c for c in root.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        ours = list(ours.values())
        for p in ours:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(ours, timeout=10)
        for p in alive:
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def test_engines_run_on_the_worker_node(cluster, tmp_path):
    address, env = cluster
    config = {
        "server": {"ray_address": address, "load_poll_s": 1.0, "auth": "open"},
        "engines": {"cpu": {
            "model": "tiny", "model_id": "tiny", "max_model_len": 1024, "kv_cache_bytes": "16MiB",
            "engine_kwargs": {"max_num_seqs": 4, "enforce_eager": True},
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0, "resources": {"kvtier_engine": 1}}},
        }},
        "tiers": [{"name": "full", "engine": "cpu"}, {"name": "k128", "engine": "cpu", "budget": 128, "buffer": 32}],
    }
    svc = ServeProcess(config, tmp_path, name="multinode", env=env)
    try:
        svc.wait_ready(timeout=600)
        print(f"\n[two-node service ready after {svc.ready_after:.0f} s]")
        assert "OPEN MODE" in svc.log()
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        # idle: the headroom rule (the default) gives full attention; the compressed tier runs when asked
        raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello world", max_tokens=8)
        assert (raw.headers["x-kvtier-tier"], raw.headers["x-kvtier-reason"]) == ("full", "headroom")
        raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello world", max_tokens=200,
                                                          extra_body={"tier": "k128"})
        assert raw.headers["x-kvtier-tier"] == "k128" and raw.parse().usage.completion_tokens == 200
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, stream=True))
        assert chunks
        stats = httpx.get(svc.url + "/v1/kvtier/stats", params={"eviction": "true"}, timeout=30).json()
        engine = stats["engines"]["cpu"]
        assert engine["eviction"]["events"] > 0
        nodes = json.loads(subprocess.run(
            [str(Path(RAY).with_name("python")), "-c",
             "import json, ray; ray.init(address=%r, logging_level='ERROR'); "
             "print(json.dumps([{'id': n['NodeID'], 'res': n['Resources']} for n in ray.nodes() if n['Alive']]))"
             % address], env=env, capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[-1])
        assert len(nodes) == 2
        [worker] = [n["id"] for n in nodes if "kvtier_engine" in n["res"]]
        assert engine["node_id"] == worker
    finally:
        code = svc.stop()
        assert code == 0, svc.log()[-3000:]
