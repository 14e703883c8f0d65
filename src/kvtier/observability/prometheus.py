"""A local Prometheus (Debian's `prometheus` binary) scraping Ray's metrics export port.

`src/kvtier/configs/prometheus.yml` (kvtier/configs/ in an installed package) is the scrape config for local
runs; `LocalPrometheus` renders it with the actual target(s), starts Prometheus on 127.0.0.1 with its own
data directory, waits until it is ready, answers instant queries, and stops it. Used by `kvtier serve --prometheus` and the live tests.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import httpx
import yaml

CONFIG_TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "prometheus.yml"


class PrometheusError(RuntimeError):
    pass


def binary() -> str | None:
    """The prometheus executable (Debian installs /usr/bin/prometheus), or None."""
    return shutil.which("prometheus")


def render_config(targets: Sequence[str], *, scrape_interval_s: float | None = None,
                  template: Path = CONFIG_TEMPLATE) -> dict[str, Any]:
    """The local scrape config with `targets` (host:port of Ray metrics export ports) filled in."""
    cfg = yaml.safe_load(template.read_text())
    for job in cfg["scrape_configs"]:
        labels = job["static_configs"][0].get("labels")
        job["static_configs"] = [{"targets": list(targets), **({"labels": labels} if labels else {})}]
    if scrape_interval_s is not None:
        interval = f"{int(scrape_interval_s * 1000)}ms"
        cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = interval
    return cfg


class PrometheusAPI:
    """The few calls of Prometheus's HTTP API kvtier needs (instant queries, label values, targets)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: the result vector (each {"metric": labels, "value": [t, "v"]})."""
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"query failed ({r.status_code}): {expr}\n{body.get('error', r.text[:500])}")
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an expression that yields at most one series (None when empty)."""
        result = self.query(expr)
        if len(result) > 1:
            raise PrometheusError(f"{expr} returned {len(result)} series")
        return float(result[0]["value"][1]) if result else None

    def label_values(self, label: str, match: str) -> list[str]:
        return self.http.get(f"/api/v1/label/{label}/values", params={"match[]": match}).json()["data"]

    def targets(self) -> list[dict[str, Any]]:
        return self.http.get("/api/v1/targets").json()["data"]["activeTargets"]

    def close(self) -> None:
        self.http.close()


class LocalPrometheus(PrometheusAPI):
    """Prometheus on 127.0.0.1:`port` scraping `targets`; a context manager."""

    def __init__(self, targets: Sequence[str], port: int = 9090, *, scrape_interval_s: float | None = None,
                 data_dir: str | Path | None = None, log_path: str | Path | None = None):
        exe = binary()
        if exe is None:
            raise PrometheusError("prometheus is not installed (Debian: apt-get install prometheus; "
                                  "`make system-deps` does it)")
        self.port = port
        super().__init__(f"http://127.0.0.1:{port}")
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="kvtier-prometheus-")
        self.dir = Path(data_dir or self._tmp.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(render_config(targets, scrape_interval_s=scrape_interval_s)))
        self.log_path = Path(log_path) if log_path else self.dir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            try:
                if self.http.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout} s:\n{self.log()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.close()
        self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "LocalPrometheus":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
