"""`kvtier serve [--config src/kvtier/configs/local.yaml]`: start Ray and the service, print a ready line and an
example request, and shut everything down on Ctrl-C (SIGINT) or SIGTERM (what Kubernetes and process
managers send), also when started as a background job (which starts with SIGINT ignored)."""

from __future__ import annotations

import json
import shlex
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import typer


def example_request(url: str, model: str, api_key: str | None = None, task_prompt: str | None = None,
                    max_tokens: int = 1200) -> str:
    """A curl line for the first model: a chat request, or with task_prompt (a model trained on one task
    without a chat template: the shipped reasoner) a greedy completion of that prompt in max_tokens."""
    if task_prompt is None:
        route = "chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": "Think step by step: what is 6 x 7?"}],
                "max_tokens": 32}
    else:
        route = "completions"
        body = {"model": model, "prompt": task_prompt, "max_tokens": max_tokens, "temperature": 0}
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"curl -s -i {url}/v1/{route} -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


def task_example(cfg, model_id: str) -> tuple[str, int] | None:
    """(a held-out local problem's prompt, its family's max_tokens) when the engine serving `model_id` runs
    a reasoner: a shipped one, or a directory that records the task family it was trained on (a training's
    TRAINING.json or an exported checkpoint's EXPORT.json); that family's (chains, or chains-long)."""
    from kvtier.models.reasoner import recorded_family, trained_family
    from kvtier.tasks.chains import FAMILIES

    from .app import resolve_model_path
    from .config import REASONER_MODELS

    model = next((e.model for n, e in cfg.engines.items() if cfg.model_id(n) == model_id), None)
    if model is None:
        return None
    path = resolve_model_path(model)
    fam = FAMILIES.get(trained_family(path) if model in REASONER_MODELS else recorded_family(path))
    if fam is None:
        return None
    return fam.eval_problems(1, "local")[0].prompt, fam.max_tokens


def example_tier(cfg, model_id: str, prompt: str | None, max_tokens: int) -> str:
    """'tier NAME (reason)' the router gives the example request on an idle service (routing.route)."""
    from .app import resolve_model_path
    from .routing import RequestShape, RouteError, route
    from .tokens import PromptCounter

    engine = next(n for n in cfg.engines if cfg.model_id(n) == model_id)
    if prompt is None:
        return "the router's choice (a chat request; its length decides)"
    n = PromptCounter(resolve_model_path(cfg.engines[engine].model)).completion(prompt)
    try:
        d = route(cfg, RequestShape(prompt_tokens=n, max_tokens=max_tokens, model=model_id), {t.name for t in cfg.tiers})
    except RouteError as exc:
        return f"refused ({exc.reason})"
    return f"tier {d.tier.name} ({d.reason}) when the engine is not under KV pressure"


def _check_engines(path: Path, engines: list[str]) -> None:
    """`kvtier serve --check`: every engine's `kvtier engine check` before Ray starts; exit 1 on any FAIL."""
    from kvtier.evaluation.engine_check.cli import EXIT_FAILED, check_service, report_lines

    typer.echo(f"kvtier serve: checking {len(engines)} engine(s) on this machine (kvtier engine check) ...")
    reports = check_service(path, engines)
    for report in reports:
        for line in report_lines(report):
            typer.echo(line)
    failed = [f"{r['target']}: {', '.join(r['failed'])}" for r in reports if not r["ok"]]
    if failed:
        typer.echo(f"kvtier serve: not starting, engine check FAILED ({'; '.join(failed)})", err=True)
        raise typer.Exit(EXIT_FAILED)


def serve_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help="Service YAML (default: src/kvtier/configs/local.yaml)."),
    host: Optional[str] = typer.Option(None, help="Override server.host."),
    port: Optional[int] = typer.Option(None, help="Override server.port."),
    prometheus: bool = typer.Option(False, "--prometheus", help="Also start Debian's Prometheus on 127.0.0.1, "
                                    "scraping Ray's metrics export port (src/kvtier/configs/prometheus.yml)."),
    prometheus_port: int = typer.Option(9090, help="Prometheus's port with --prometheus."),
    scrape_interval: Optional[float] = typer.Option(None, help="Prometheus's scrape interval in seconds with "
                                                    "--prometheus (default: src/kvtier/configs/prometheus.yml, 5 s)."),
    metrics_port: Optional[int] = typer.Option(None, help="Ray's metrics export port (server.metrics_export_port; "
                                               "8080 with --prometheus unless set)."),
    check: bool = typer.Option(False, "--check", help="First run `kvtier engine check` for each engine on this "
                               "machine; refuse to start on any FAIL, naming the check."),
) -> None:
    """Serve the OpenAI-compatible API with KV-memory tiers on Ray Serve."""
    from .config import DEFAULT_CONFIG, ConfigError, load_config
    from .launch import start, stop

    path = config or DEFAULT_CONFIG
    try:
        cfg = load_config(path)
        cfg.api_keys()   # fail closed before Ray starts: a tenant's keys variable or file missing or empty
    except ConfigError as exc:
        typer.echo(f"kvtier serve: {exc}", err=True)
        raise typer.Exit(2) from None
    if metrics_port is not None or (prometheus and cfg.server.metrics_export_port is None):
        cfg.server.metrics_export_port = metrics_port or 8080
    if prometheus:
        from kvtier.observability.prometheus import binary

        if binary() is None:
            typer.echo("kvtier serve: --prometheus needs Debian's prometheus (apt-get install prometheus, "
                       "or `make system-deps`)", err=True)
            raise typer.Exit(2)
        if cfg.server.ray_address is not None:
            typer.echo("kvtier serve: --prometheus scrapes a local Ray only (server.ray_address is set)", err=True)
            raise typer.Exit(2)
    typer.echo(f"kvtier serve: config {path}")
    from .tier_report import sweep_lines, tier_lines

    measured, across = tier_lines(cfg), sweep_lines(cfg)
    for t in cfg.tiers:
        budget = (f"K={t.budget} r={t.buffer} policy={t.policy}" if t.compressed else f"elastic: full attention, "
                  f"floor K={t.floor} r={t.buffer} policy={t.policy} when blocks run out" if t.elastic else "full attention")
        typer.echo(f"  tier {t.name:<12} engine {t.engine:<10} {budget}{'' if t.auto else ' (explicit only)'}")
        if t.name in measured:
            typer.echo(f"       measured: {measured[t.name]}")
        if t.name in across:
            typer.echo(f"       across load: {across[t.name]}")
    if "auto" in measured:
        typer.echo(f"  routing auto   measured: {measured['auto']}")
    if "auto" in across:
        typer.echo(f"  routing auto   across load: {across['auto']}")
    for name, eng in cfg.engines.items():
        from .app import resolve_model_path
        from kvtier.engine.cpu_dtype import bf16_slow_path_note

        from .sizing import resolved_engine_kwargs

        kwargs, why = resolved_engine_kwargs(cfg, name, resolve_model_path(eng.model))
        typer.echo(f"  engine {name:<10} max_num_seqs {kwargs.get('max_num_seqs', 'vLLM default')}, dtype "
                   f"{kwargs.get('dtype', 'the model config')}" + (f" ({why})" if why else ""))
        note = bf16_slow_path_note(kwargs.get("dtype"), eng.accelerator)
        if note:
            typer.echo(f"  engine {name:<10} {note}")
    if cfg.open_mode:
        typer.echo("kvtier serve: OPEN MODE (server.auth: open) - no API keys; anyone who can reach the port may use "
                   "every tier")
    if check:
        _check_engines(path, list(cfg.engines))
    stop_event = threading.Event()
    phase = {"now": "starting"}

    def on_signal(signum, frame):
        if phase["now"] == "stopping":
            typer.echo(f"kvtier serve: {signal.Signals(signum).name} again: already shutting down", err=True)
            return
        stop_event.set()
        if phase["now"] == "starting":   # interrupt the start-up; the finally block cleans up
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):   # SIGINT explicitly: a background job starts with it ignored
        signal.signal(sig, on_signal)
    running = prom = None
    try:
        typer.echo("kvtier serve: starting Ray and the engines (about a minute on CPU) ...")
        running = start(cfg, host=host, port=port)
        phase["now"] = "serving"
        typer.echo(f"kvtier serve: READY at {running.url} (models: {', '.join(cfg.model_ids)}) "
                   f"after {running.seconds:.0f} s. Ctrl-C or SIGTERM to stop.")
        if running.session_dir:
            typer.echo(f"kvtier serve: local Ray session {running.session_dir}")
        key = None
        if not cfg.open_mode:
            key = "$KVTIER_API_KEY"
        model_id = cfg.model_ids[0]
        prompt, max_tokens = task_example(cfg, model_id) or (None, 1200)
        typer.echo(f"Example request (routed to {example_tier(cfg, model_id, prompt, max_tokens)}; add "
                   f"-H '{cfg.routing.tier_header}: full' for full attention):\n  "
                   + example_request(running.url, model_id, key, prompt, max_tokens))
        if cfg.server.metrics_export_port:
            typer.echo(f"kvtier serve: Ray metrics at http://127.0.0.1:{cfg.server.metrics_export_port}/metrics")
        if prometheus:
            from kvtier.observability.prometheus import LocalPrometheus

            prom = LocalPrometheus([f"127.0.0.1:{cfg.server.metrics_export_port}"], prometheus_port,
                                   scrape_interval_s=scrape_interval)
            prom.wait_ready()
            typer.echo(f"kvtier serve: Prometheus at {prom.url} (scraping 127.0.0.1:{cfg.server.metrics_export_port}; "
                       "dashboards: kvtier dashboards export|push)")
        while not stop_event.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        phase["now"] = "stopping"
        typer.echo("kvtier serve: shutting down ...")
        t0 = time.monotonic()
        if prom is not None:
            prom.stop()
        stop(running)
        typer.echo(f"kvtier serve: stopped ({time.monotonic() - t0:.0f} s)")
    if running is not None and running.started_ray:
        # Stopped cleanly, nothing left to do: end here rather than in the interpreter's finalization, which
        # took 3.5-6.5 s after the stopped line (issue #61: SIGTERM to exit within 10 s). ray.shutdown() leaves
        # Ray's C++ threads running in this process (its GCS client's io_service, the core worker's pool,
        # OpenCensus's harvester); tests/conftest.py ends the test process the same way for the same reason.
        import logging
        import os
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
