"""The service's commands in the `kvtier` CLI: `kvtier serve` (serve_cli.py) and `kvtier k8s serve-config`
(k8s_config.py)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add `kvtier serve` and `kvtier k8s` to the `kvtier` CLI."""
    from .k8s_config import k8s_app
    from .serve_cli import serve_command

    app.command("serve")(serve_command)
    app.add_typer(k8s_app, name="k8s")
