"""`kvtier serve` stops cleanly: the embedded default config (tiny model, local Ray: direct ingress; once with
Serve's proxy) started as a subprocess in its own session, one request served, then SIGTERM (what Kubernetes and process
managers send) or SIGINT to a background job (which starts with SIGINT ignored). It must exit 0 within
10 s (issue #61: `make serve` had taken 19 s, its stop budget then 20 s) and leave no process of its
Ray session behind: none of its descendants (Ray's head processes and agents, Serve's controller, proxy and
replicas, the vLLM engine processes) and nothing whose command line names the session. The SIGTERM case stops
with a long generation still streaming, which Serve's graceful drain alone would wait for (up to its 20 s
graceful_shutdown_timeout_s)."""

from __future__ import annotations

import re
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("ray.serve")
pytest.importorskip("vllm")

from service_helpers import ServeProcess, run_in_thread, thread_nices  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]
STOP_BOUND_S = 10.0   # `make serve` exits within this of SIGTERM / Ctrl-C (issue #61)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return str(p.pid)


def _session_processes(session: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if session in " ".join(p.info["cmdline"] or ()):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("sig, background, ingress", [(signal.SIGTERM, False, "proxy"), (signal.SIGINT, True, None)],
                         ids=["sigterm-proxy-ingress", "sigint-background-job-default-ingress"])
def test_serve_stops_cleanly_and_leaves_no_process(tmp_path, sig, background, ingress):
    """The embedded default (`server.ingress: auto`, direct on a local Ray with one router, #27/#37): the
    router replica itself listens on the port in Serve's throughput-optimized mode, at nice 0 (it does the
    HTTP work), and records its first chunk's send; and `server.ingress: proxy`: Serve's proxy on the port,
    the router at the serving nice value."""
    config = None
    if ingress is not None:
        import yaml

        from kvtier.service.config import DEFAULT_CONFIG

        config = yaml.safe_load(open(DEFAULT_CONFIG))
        config.setdefault("server", {})["ingress"] = ingress
    svc = ServeProcess(config, tmp_path, as_background_job=background)
    procs: list[psutil.Process] = []
    try:
        svc.wait_ready()
        log = svc.log()
        # `kvtier serve` (`make serve TINY=1`) shows the batch limit the embedded config's
        # `max_num_seqs: auto` resolved to
        # and the dtype `auto` chose: float32 on a CPU without AVX512-BF16/AMX (64 MiB: half the blocks), where
        # bfloat16 matmuls would take torch's slow path; the model's bfloat16 elsewhere
        from kvtier.engine.cpu_dtype import native_bf16

        if native_bf16() is False:
            assert ("engine cpu        max_num_seqs 64, dtype float32 (max_num_seqs auto = 64: 128 blocks" in log
                    and "dtype auto = float32: this CPU has no AVX512-BF16/AMX" in log), log[:3000]
        else:
            assert "engine cpu        max_num_seqs 128, dtype the model config (max_num_seqs auto = 128: 256 blocks" in log, log[:3000]
        assert "on a CPU without AVX512-BF16/AMX: vLLM's oneDNN" not in log      # the slow path is never the default
        match = re.search(r"local Ray session (\S+)", log)
        assert match, log[-3000:]
        session = match.group(1)
        since = time.time()
        with httpx.Client(base_url=svc.url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            r = http.post("/v1/completions", json={"model": model, "prompt": "Hello world", "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvtier-tier"] and r.json()["usage"]["completion_tokens"] >= 1
            body = {"model": model, "prompt": "Hello world", "max_tokens": 8, "stream": True}
            with http.stream("POST", "/v1/completions", json=body, headers={"x-kvtier-tier": "full"}) as r:
                assert r.status_code == 200 and r.headers["x-kvtier-tier"] == "full"
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 2
            stats = http.get("/v1/kvtier/stats", params={"ttft_since": since}).json()["ttft_breakdown"]["full"]
            assert stats["engine"]["n"] == 2 and stats["send"]["n"] == 1   # the stream's first chunk's send

        procs = svc.descendants()
        names = " | ".join(_describe(p) for p in procs)
        for needle in ("raylet", "gcs_server", "DashboardAgent", "RuntimeEnvAgent", "ServeController",
                       "ProxyActor", "ServeReplica:kvtier:engine", "VLLM::EngineCore"):
            assert needle in names, f"{needle} not among the service's processes: {names}"
        assert _session_processes(session), "no process names the Ray session before the stop"
        # who listens on the service port: Serve's proxy (default), or the router itself in Serve's
        # throughput-optimized mode (direct ingress)
        listeners = {c.laddr.port: p for p in procs for c in _listening(p)}
        on_port = _describe(listeners[svc.port])
        direct = ingress is None
        if direct:
            assert "ServeReplica:kvtier:KVTierRouter" in on_port, on_port
            assert listeners[svc.port].environ().get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
        else:
            assert "ProxyActor" in on_port, on_port
        # CPU priority (service/cpu_priority.py): vLLM's processes at nice 0, Serve's and Ray's at 19, the
        # router at 0 when it serves HTTP itself (server.router_nice's default)
        router_nice = 0 if direct else 19
        assert "Ray's and Serve's processes run at nice 19, vLLM's engine processes at 0" in log, log[-3000:]
        assert ("the router at 0 (server.router_nice)" in log) == direct, log[-3000:]
        nice = {_describe(p): thread_nices(p) for p in procs}
        assert any("ServeReplica:kvtier:KVTierRouter" in name for name in nice), list(nice)
        for name, values in nice.items():
            if "VLLM::" in name:
                assert values == {0}, (name, values)
            elif "ServeReplica:kvtier:KVTierRouter" in name:
                assert values == {router_nice}, (name, values)
            elif any(k in name for k in ("ProxyActor", "ServeController", "ServeReplica:kvtier:", "DashboardAgent")):
                assert values == {19}, (name, values)

        in_flight = sig == signal.SIGTERM
        if in_flight:   # a generation far longer than the bound, streaming when the signal comes
            streamed = []
            thread, box = run_in_thread(_long_stream, svc.url, model, streamed)
            deadline = time.time() + 120
            while len(streamed) < 3 and thread.is_alive() and time.time() < deadline:
                time.sleep(0.1)
            assert len(streamed) >= 3 and thread.is_alive(), (box, svc.log()[-3000:])
        t0 = time.time()
        svc.proc.send_signal(sig)
        code = svc.proc.wait(60)
        took = time.time() - t0
        log = svc.log()
        print(f"\n[{signal.Signals(sig).name}: exit {code} after {took:.1f} s; {len(procs)} processes watched"
              f"{'; a generation in flight' if in_flight else ''}]")
        assert code == 0, log[-3000:]
        assert "kvtier serve: stopped" in log, log[-3000:]
        assert took <= STOP_BOUND_S, f"took {took:.1f} s to exit\n{log[-3000:]}"
        if in_flight:
            thread.join(30)
            assert streamed[-1] != "data: [DONE]", "the generation finished before the stop: make it longer"
        else:   # idle: Serve drained within its budget
            assert "did not shut down in time" not in log, log[-3000:]
        left = [_describe(p) for p in procs if _alive(p)]
        assert not left, f"left running after exit: {left}\n{log[-2000:]}"
        named = [_describe(p) for p in _session_processes(session) if _alive(p)]
        assert not named, f"processes of {session} left: {named}"
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait(10)
        for p in procs:   # only what this test's service started
            if _alive(p):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        svc.stop()


def _long_stream(url: str, model: str, streamed: list) -> None:
    """A full-attention stream of 4,000 tokens (EOS ignored), its SSE lines appended to `streamed` as they come;
    ends when the service goes away."""
    body = {"model": model, "prompt": "Hello world", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body, headers={"x-kvtier-tier": "full"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streamed.append(line)
    except httpx.HTTPError:
        pass   # the service stopped mid-stream


def _listening(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []
