"""Start and stop the service on Ray: a local Ray (or an existing cluster), Serve's HTTP proxy, the app.

`stop()` is bounded: on a Ray that `start()` launched it shuts Serve down, then Ray, then makes sure every
process of that Ray session is gone (Ray's head processes, its agents, Serve's actors, the vLLM engine
processes), terminating and finally killing what is left, all within about 8.5 s (`kvtier serve` exits
within 10 s of SIGTERM, issue #61). On a cluster it only joined, it deletes its app.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .config import ServiceConfig
from .cpu_priority import PriorityKeeper, prepare_local_ray, replica_titles
from .ports import free_port

logger = logging.getLogger("kvtier.service")
# what start() brought up in this process, for stop(): Ray (and its session directory), the app
_OWNED: dict = {"ray": False, "app": None, "session_dir": None, "priority": None}
# stop(): graceful Serve + Ray shutdown within this, then the session's leftovers get SIGTERM (1 s to go), then
# SIGKILL (0.5 s): `kvtier serve` exits within 10 s of SIGTERM (issue #61), well inside Kubernetes' 30 s grace.
# On a Ray of our own, Serve's graceful shutdown gets all but the last STOP_RAY_S of it: idle it takes ~2 s
# (app.DRAIN_CHECK_S); a request still running when that budget ends is cut off with the rest of Ray.
STOP_TIMEOUT_S = 7.0
STOP_RAY_S = 3.0


@dataclass
class Running:
    url: str
    app_name: str
    started_ray: bool
    seconds: float
    session_dir: str | None = None   # the local Ray session this process started


def _direct_ingress_env(port: int) -> None:
    """Ray Serve's direct ingress for the Ray about to start: the ingress (router) replica serves HTTP on
    `port` itself (Serve allocates ingress ports from this one-port range), in Serve's throughput-optimized
    mode (its bundle for direct ingress: user code on the replica's own event loop, no thread hop per
    message; handles over gRPC; request logs buffered). Measured under the 16-request burst on 2 cores:
    direct ingress alone 1.66x stock's mean TTFT, with this mode 1.05x (docs/serving.md)."""
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(port + 1)
    # Serve holds a stopping direct-ingress replica open >= 30 s by default so an external load balancer can
    # deregister it; here the port is this process's own (local Ray, one router), so there is none to wait
    # for, and 30 s would outlast stop()'s Serve budget (whose timeout path ends the process with exit 1)
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")


def _ray_init(cfg: ServiceConfig, port: int) -> bool:
    import ray

    if ray.is_initialized():
        return False
    # Ray's core worker installs a C++ failure handler for SIGTERM in the driver (it aborts the process);
    # keep the Python handlers the caller installed (kvtier serve's clean shutdown).
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        address = cfg.server.ray_address
        if address is None:
            # A cluster of our own; token auth is for shared clusters (Ray 2.60 turns it on by default).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            # Serve's controller reconciles every 0.1 s by default: 3.5% of a core on an idle service here
            # (GCS traffic included), taken from the engine on a CPU box; replica restarts and scaling
            # react within 0.5 s instead. Requests never wait on the controller.
            os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
            if cfg.server.serving_nice:
                prepare_local_ray()   # Ray's workers, hence vLLM's processes, at nice 0 (not Ray's 15)
            if cfg.server.direct_ingress:
                _direct_ingress_env(port)
            _OWNED["ray"] = True   # from here on: a stop() (even mid-start) reaps what it launched
            ray.init(address="local", num_cpus=cfg.server.num_cpus, include_dashboard=False,
                     logging_level=logging.WARNING, log_to_driver=False,
                     _metrics_export_port=cfg.server.metrics_export_port)
            return True
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return False
    finally:
        for sig, handler in handlers.items():
            if callable(handler) and handler not in (signal.default_int_handler,):
                signal.signal(sig, handler)


def start(cfg: ServiceConfig, *, host: str | None = None, port: int | None = None) -> Running:
    """Start (or join) Ray, Serve's proxy and the app; return once every deployment is ready."""
    t0 = time.time()
    for name in ("ray.serve", "ray.llm"):  # the driver's INFO chatter (deployment option dumps)
        logging.getLogger(name).setLevel(logging.WARNING)
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    serve_imported = "ray.serve._private.constants" in sys.modules
    started_ray = _ray_init(cfg, port)
    # Serve reads its environment once, at import, in every process, the driver included: the handles the
    # driver binds into the app (the router's to the engines) carry the driver's defaults (gRPC or not,
    # the handle's router loop), so Serve is imported here only after _ray_init set the environment
    from ray import serve

    from .app import build_application

    if started_ray and cfg.server.direct_ingress and serve_imported:
        logger.warning("kvtier: Ray Serve was imported before kvtier serve set its throughput-optimized mode: "
                       "the engines' handles keep Serve's defaults in this process")
    _OWNED.update(ray=started_ray or _OWNED["ray"], app=cfg.server.app_name)
    if started_ray:
        from .ray_compat import session_dir

        _OWNED["session_dir"] = session_dir()
        if cfg.server.serving_nice:
            from .app import ROUTER_DEPLOYMENT, deployment_name

            engines = tuple(t for n in cfg.engines for t in replica_titles(cfg.server.app_name, deployment_name(n)))
            router_nice = cfg.server.router_nice_value
            own = (None if router_nice == cfg.server.serving_nice
                   else (replica_titles(cfg.server.app_name, ROUTER_DEPLOYMENT), router_nice))
            _OWNED["priority"] = PriorityKeeper(cfg.server.serving_nice, skip=engines, own=own,
                                               session_dir=_OWNED["session_dir"]).start()
    # direct ingress: the router replica takes `port`, Serve's proxy (still started) another one
    if cfg.server.ingress == "direct" and not started_ray:
        raise ValueError("server.ingress 'direct' needs the Ray that kvtier serve starts (Ray is already "
                         "running in this process); use ingress 'proxy' or 'auto'")
    proxy_port = free_port(host) if started_ray and cfg.server.direct_ingress else port
    serve.start(proxy_location=cfg.server.proxy_location, http_options={"host": host, "port": proxy_port})
    app, _ = build_application(cfg, local_ray=started_ray)
    serve.run(app, name=cfg.server.app_name, route_prefix="/", blocking=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return Running(f"http://{shown}:{port}", cfg.server.app_name, started_ray, time.time() - t0,
                   _OWNED["session_dir"] if started_ray else None)


def stop(running: Running | None = None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Delete our app and, when we started Ray, shut Serve and Ray down and reap every process of that Ray
    session. Bounded by about timeout_s + 1.5 s. Safe after a failed (or interrupted) start: on a cluster we
    only joined, nothing but our app is touched."""
    import ray
    from ray import serve

    owned_ray, session_dir = _OWNED["ray"], _OWNED["session_dir"]
    if _OWNED["priority"] is not None:
        _OWNED["priority"].stop()
        _OWNED["priority"] = None
    procs = _descendants() if owned_ray else []   # before Ray goes: its agents outlive the raylet otherwise
    if not ray.is_initialized():
        _reap(procs, session_dir, time.monotonic() + timeout_s)
        _OWNED.update(ray=False, app=None, session_dir=None)
        return
    deadline = time.monotonic() + timeout_s
    app = running.app_name if running is not None else _OWNED["app"]

    def shut_serve():
        if owned_ray:
            serve.shutdown()   # every app, the proxies and the controller: the cluster is ours
        elif app is not None:
            serve.delete(app)  # engines drain and their vLLM processes exit

    try:
        if not _bounded(shut_serve, deadline - STOP_RAY_S if owned_ray else deadline, "Serve shutdown"):
            logger.warning("Serve did not shut down in time; stopping Ray anyway")
    finally:
        if owned_ray:
            _bounded(ray.shutdown, deadline - STOP_RAY_S / 2, "Ray shutdown")
            _reap(procs, session_dir, deadline)
        _OWNED.update(ray=False, app=None, session_dir=None)


def _bounded(fn, deadline: float, what: str) -> bool:
    """Run fn in a daemon thread; False if it raised or is still running at the deadline."""
    box: dict = {}

    def target():
        try:
            fn()
            box["ok"] = True
        except Exception as exc:  # noqa: BLE001 - shutdown goes on
            logger.warning("%s: %s", what, exc)

    t = threading.Thread(target=target, name=f"kvtier-{what}", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    return bool(box.get("ok"))


def _descendants() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _reap(procs: list, session_dir: str | None, deadline: float) -> None:
    """Wait for the processes of our Ray session to exit (the snapshot of this process's descendants taken
    before Ray shut down, plus any process whose command line names our session directory), then
    SIGTERM and SIGKILL what is left. psutil refuses to signal a pid that was reused since the snapshot."""
    import psutil

    procs = list(procs)
    if session_dir:
        pids = {p.pid for p in procs}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.pid not in pids and p.pid != os.getpid() and session_dir in " ".join(p.info["cmdline"] or ()):
                    procs.append(p)
            except psutil.Error:
                pass
    alive = _wait_gone(procs, max(0.5, deadline - time.monotonic()))
    for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.5)):
        if not alive:
            return
        logger.warning("kvtier: %s to %d leftover process(es) of the Ray session: %s", sig.name, len(alive),
                       ", ".join(_describe(p) for p in alive[:10]))
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        alive = _wait_gone(alive, wait_s)


def _wait_gone(procs: list, timeout: float) -> list:
    end = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.2)


def _running(p) -> bool:
    """Alive and not a zombie (our own exited children are reaped here)."""
    import psutil

    try:
        if not p.is_running():   # gone, or its pid now belongs to another process
            return False
        if p.status() == psutil.STATUS_ZOMBIE:
            if p.ppid() == os.getpid():
                os.waitpid(p.pid, os.WNOHANG)
            return False
        return True
    except (psutil.Error, ChildProcessError):
        return False


def _describe(p) -> str:
    try:
        return f"{p.pid} ({p.name()})"
    except Exception:  # noqa: BLE001
        return str(p.pid)
