"""Option parsing the `kvtier eval` command modules share (cli.py and reasoner_cli.py import it; neither
imports the other's module at import time)."""

from __future__ import annotations

import typer

POLICIES_HELP = ("Comma-separated policies: a registered name or name:key=value[:key=value] with the policy's "
                 "parameters (values JSON scalars, else strings), e.g. random,random_reserve:reserve=0.1; "
                 "each parameter set is its own row, named random_reserve(reserve=0.1).")


def csv_list(text: str | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def policy_items(text: str | None) -> list[str]:
    """--policies items, each parsed and its policy built now: an unknown policy or parameter is a usage
    error (exit 2) naming it, before any model or engine loads."""
    from .policy_spec import parse_policies

    items = csv_list(text)
    try:
        parse_policies(items)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--policies'") from None
    return items
