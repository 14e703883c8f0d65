"""Policies with parameters in an evaluation grid: a `--policies` item is a registered name or
``name:key=value[:key=value]`` (``random_reserve:reserve=0.1``), each value a JSON scalar (int, float,
bool) or else a string. One item is one row of the grid; `variant_name` names it in cells, tables, JSON
and plots (``random_reserve(reserve=0.1)``), so two variants of one policy stay apart."""

from __future__ import annotations

import json
from typing import Any, Sequence


def parse_value(text: str) -> Any:
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return text
    return v if isinstance(v, (bool, int, float)) else text


def parse_policy_spec(item: str) -> tuple[str, dict[str, Any]]:
    """'random_reserve:reserve=0.1' -> ('random_reserve', {'reserve': 0.1}); syntax only (`parse_policies`
    also builds the policy)."""
    name, *pairs = item.strip().split(":")
    if not name:
        raise ValueError(f"policy item {item!r} has no policy name")
    params: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"policy item {item!r}: expected key=value after ':', got {pair!r}")
        if key in params:
            raise ValueError(f"policy item {item!r} sets {key!r} twice")
        params[key] = parse_value(value.strip())
    return name, params


def parse_policies(items: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Parse every item and build its policy, so an unknown policy or parameter (or a bad value) is refused
    by name before any engine starts. Raises ValueError (PolicyError is one)."""
    from kvtier.policies import make_policy

    out = []
    for item in items:
        name, params = parse_policy_spec(item)
        if name == "full":
            if params:
                raise ValueError(f"'full' (no eviction) takes no parameters, got {item!r}")
        else:
            make_policy(name, **params)
        out.append((name, params))
    return out


def variant_name(name: str, params: dict[str, Any]) -> str:
    """'random_reserve', {'reserve': 0.1} -> 'random_reserve(reserve=0.1)'; no parameters: the name."""
    if not params:
        return name
    fmt = lambda v: v if isinstance(v, str) else json.dumps(v)   # noqa: E731  true/false as typed
    return f"{name}({','.join(f'{k}={fmt(v)}' for k, v in sorted(params.items()))})"
