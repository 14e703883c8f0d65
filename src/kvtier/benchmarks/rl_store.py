"""The runs `kvtier bench rl` keeps: one JSON file per finished run (and one for the start's evaluation), with
the settings it ran under as its key, so a stopped bench resumes where it stopped and a changed setting
reruns only the runs it concerns."""

from __future__ import annotations

import json
import os
from pathlib import Path


def reuse(path: Path, key: dict) -> dict | None:
    """A finished run kept at `path` if it ran with the settings `key`, else None."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):              # none, or cut off mid-write: run it again
        return None
    return kept["run"] if kept.get("key") == key else None


def keep(path: Path, key: dict, run: dict) -> None:
    """Write a finished run whole or not at all (a bench stopped mid-write leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "run": run}))
    os.replace(tmp, path)


def differing_settings(path: Path, key: dict) -> list[str]:
    """The settings in which the run kept at `path` differs from `key` (empty: none kept, or the same)."""
    try:
        kept = json.loads(path.read_text()).get("key") or {}
    except (OSError, ValueError):
        return []
    return sorted(k for k in set(kept) | set(key) if kept.get(k) != key.get(k))
