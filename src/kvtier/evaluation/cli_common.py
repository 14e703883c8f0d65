"""Option parsing the `kvtier eval` command modules share (cli.py and reasoner_cli.py import it; neither
imports the other's module at import time)."""

from __future__ import annotations


def csv_list(text: str | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]
