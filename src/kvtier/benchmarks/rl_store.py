"""The runs `kvtier bench rl` keeps: one JSON file per finished run (and one for the start's evaluation), with
the settings it ran under as its key, so a stopped bench resumes where it stopped and a changed setting
reruns only the runs it concerns."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_kept(path: Path) -> dict:
    """The kept file's {"key", "run"}; {} when there is none or it was cut off mid-write (run it again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def reuse(path: Path, key: dict) -> dict | None:
    """A finished run kept at `path` if it ran with the settings `key`, else None."""
    kept = read_kept(path)
    return kept["run"] if kept and kept.get("key") == key else None


def keep(path: Path, key: dict, run: dict) -> None:
    """Write a finished run whole or not at all (a bench stopped mid-write leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "run": run}))
    os.replace(tmp, path)


def differing_settings(path: Path, key: dict) -> list[str]:
    """The settings in which the run kept at `path` differs from `key` (empty: none kept, or the same)."""
    kept = read_kept(path).get("key") or {}
    if not kept:
        return []
    return sorted(k for k in set(kept) | set(key) if kept.get(k) != key.get(k))
