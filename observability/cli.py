"""`kvtier dashboards` commands (not implemented yet)."""

from __future__ import annotations

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to the `kvtier` CLI."""
