"""Helpers for the service tests: run `kvtier serve` as a subprocess (as `make serve` does), wait for its
ready line, stop it with Ctrl-C (SIGINT), and find its Ray processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

from kvtier.service.ports import free_port  # noqa: F401 - a port Ray's own start cannot take first

ROOT = Path(__file__).resolve().parents[1]
KVTIER = str(Path(sys.executable).with_name("kvtier"))


def service_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_ENABLE_V1_MULTIPROCESSING", "RAY_ADDRESS"))}
    env.update({"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


class ServeProcess:
    """`kvtier serve --config FILE --port N` in its own session (process group); output goes to a log file.
    config=None: the embedded default (src/kvtier/configs/local.yaml). as_background_job: start with SIGINT ignored,
    as a shell's background job (`kvtier serve &`) is."""

    def __init__(self, config: dict | None, tmp: Path, name: str = "service", env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), as_background_job: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [KVTIER, "serve"]
        if config is not None:
            self.config_path = tmp / f"{name}.yaml"
            self.config_path.write_text(yaml.safe_dump(config))
            cmd += ["--config", str(self.config_path)]
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if as_background_job else None
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port), *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=ROOT, env=env or service_env(),
                                     start_new_session=True, preexec_fn=preexec)
        self.ready_after: float | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600, line: str = "READY at") -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if line in self.log():
                self.ready_after = time.time() - t0
                return self.ready_after
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(1)
        raise TimeoutError(f"kvtier serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def find(self, needle: str) -> list[psutil.Process]:
        out = []
        for p in self.descendants():
            try:
                if needle in " ".join(p.cmdline()):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def stop(self, timeout: float = 90) -> int:
        """Ctrl-C, as a user would; then make sure nothing of ours is left behind."""
        procs = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _, alive = psutil.wait_procs(procs, timeout=20)
        for p in alive:  # only processes this service started
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()
        return self.proc.returncode


def run_in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        t0 = time.time()
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc
        box["seconds"] = time.time() - t0

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def thread_nices(p: psutil.Process) -> set[int]:
    """The nice values of a process's threads (nice is per thread on Linux); threads or a process that
    exit meanwhile are skipped."""
    out = set()
    try:
        for t in p.threads():
            try:
                out.add(os.getpriority(os.PRIO_PROCESS, t.id))
            except OSError:
                pass
    except psutil.Error:
        pass
    return out
