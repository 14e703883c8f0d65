"""Start and stop the service on Ray: a local Ray (or an existing cluster), Serve's HTTP proxy, the app."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from .config import ServiceConfig

logger = logging.getLogger("kvtier.service")
_OWNED: dict = {"ray": False, "app": None}  # what start() brought up in this process, for stop()


@dataclass
class Running:
    url: str
    app_name: str
    started_ray: bool
    seconds: float


def _ray_init(cfg: ServiceConfig) -> bool:
    import ray

    if ray.is_initialized():
        return False
    address = cfg.server.ray_address
    if address is None:
        # A cluster of our own; token auth is for shared clusters (Ray 2.60 turns it on by default).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=cfg.server.num_cpus, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False,
                 _metrics_export_port=cfg.server.metrics_export_port)
        return True
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return False


def start(cfg: ServiceConfig, *, host: str | None = None, port: int | None = None) -> Running:
    """Start (or join) Ray, Serve's proxy and the app; return once every deployment is ready."""
    from ray import serve

    from .app import build_application

    t0 = time.time()
    for name in ("ray.serve", "ray.llm"):  # the driver's INFO chatter (deployment option dumps)
        logging.getLogger(name).setLevel(logging.WARNING)
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    started_ray = _ray_init(cfg)
    _OWNED.update(ray=started_ray or _OWNED["ray"], app=cfg.server.app_name)
    serve.start(proxy_location=cfg.server.proxy_location, http_options={"host": host, "port": port})
    app, _ = build_application(cfg, local_ray=started_ray)
    serve.run(app, name=cfg.server.app_name, route_prefix="/", blocking=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return Running(f"http://{shown}:{port}", cfg.server.app_name, started_ray, time.time() - t0)


def stop(running: Running | None = None) -> None:
    """Delete our app and, when we started Ray, stop Ray (and Serve with it). Safe after a failed start:
    on a cluster we only joined, nothing but our app is touched."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    app = running.app_name if running is not None else _OWNED["app"]
    try:
        if app is not None:
            serve.delete(app)  # engines drain and their vLLM processes exit
    except Exception as exc:  # noqa: BLE001 - a failed start may have left no app; still stop our Ray
        logger.warning("deleting Serve app %s: %s", app, exc)
    finally:
        if _OWNED["ray"]:
            ray.shutdown()
        _OWNED.update(ray=False, app=None)
