"""`kvtier dashboards export|push`: the Grafana dashboards (dashboards as code, grafana-foundation-sdk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

dashboards_app = typer.Typer(no_args_is_help=True, help="Grafana dashboards: export JSON, push to Grafana.")


@dashboards_app.command("export")
def export_cmd(
    out: Path = typer.Option(..., "--out", help="Directory for the JSON files (one per dashboard, <uid>.json)."),
) -> None:
    """Write every dashboard as Grafana JSON (stable bytes; k8s/dashboards/ holds the committed copy)."""
    from .dashboards import export

    for path in export(out):
        typer.echo(str(path))


@dashboards_app.command("push")
def push_cmd(
    url: str = typer.Option(..., "--url", envvar="GRAFANA_URL", help="Grafana base URL, e.g. http://grafana:3000."),
    token: str = typer.Option(..., "--token", envvar="GRAFANA_TOKEN",
                              help="Service-account token (sent as a Bearer token). Prefer the GRAFANA_TOKEN "
                                   "env var over the command line."),
    folder: Optional[str] = typer.Option(None, "--folder", help="Folder title (created if missing)."),
    timeout: float = typer.Option(30.0, help="HTTP timeout in seconds."),
) -> None:
    """Upload every dashboard with grafana-client (overwrites the same uid; prints Grafana's answers)."""
    from grafana_client.client import GrafanaException

    from .push import push

    try:
        results = push(url, token, folder=folder, timeout=timeout)
    except GrafanaException as exc:
        typer.echo(f"Grafana refused the upload: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # connection errors come from niquests; show them without a traceback
        typer.echo(f"cannot push to {url}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(results, indent=2))


def register(app: typer.Typer) -> None:
    """Add `kvtier dashboards` to the `kvtier` CLI."""
    app.add_typer(dashboards_app, name="dashboards")
