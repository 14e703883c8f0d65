"""The service's commands in the `kvtier` CLI: `kvtier serve` (serve_cli.py), `kvtier k8s serve-config`
(k8s_config.py) and `kvtier k8s check-crd` (k8s_crd.py)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add `kvtier serve` and `kvtier k8s` to the `kvtier` CLI."""
    from .k8s_config import k8s_app
    from .k8s_crd import check_crd_command
    from .serve_cli import serve_command

    app.command("serve")(serve_command)
    k8s_app.command("check-crd")(check_crd_command)
    app.add_typer(k8s_app, name="k8s")
