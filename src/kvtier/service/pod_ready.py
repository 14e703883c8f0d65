"""Per-pod readiness: a pod is ready while the Serve replicas on it can serve (issue #61 item 1).

Each engine and router replica keeps a heartbeat file in a pod-local directory (`KVTIER_READY_DIR`, default
/tmp/ray/kvtier-ready: the Ray pods' /tmp/ray is an emptyDir of their own): its deployment, replica id, pid,
state (`serving`, or `errored` once its vLLM engine has failed) and when it last wrote. The worker pods'
readiness probe runs `python -m kvtier.service.pod_ready`, which exits 0 unless a replica on this pod is
errored or has stopped refreshing its file (its event loop stuck for `KVTIER_READY_STALE_S`, default 30 s).
Files of processes that are gone (replaced or stopped replicas) are ignored and removed; a replica that is
still starting writes nothing. So one failed engine replica takes only its own pod out of the Service, for
as long as Serve takes to replace it; the engine's health as a whole is a metric and an alert
(`ray_kvtier_router_engine_healthy`, KvtierEngineUnhealthy), not a probe.

Standard library only: the probe starts a Python every few seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

DIR_ENV, STALE_ENV = "KVTIER_READY_DIR", "KVTIER_READY_STALE_S"
DEFAULT_DIR, DEFAULT_STALE_S = "/tmp/ray/kvtier-ready", 30.0
BEAT_EVERY_S = 5.0
SERVING, ERRORED = "serving", "errored"


def ready_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


class Heartbeat:
    """One replica's heartbeat file; `beat(state)` rewrites it atomically, `clear()` removes it."""

    def __init__(self, deployment: str, replica: str, directory: Path | None = None):
        self.path = (directory or ready_dir()) / f"{deployment}.{replica}.json"
        self.deployment, self.replica = deployment, replica

    def beat(self, state: str, detail: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"deployment": self.deployment, "replica": self.replica, "pid": os.getpid(),
                                   "state": state, "detail": detail, "at": time.time()}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


async def keep_beating(heartbeat: Heartbeat, state: Callable[[], tuple[str, str]],
                       every_s: float = BEAT_EVERY_S) -> None:
    """Write `state()` -> (state, detail) every `every_s` on the running loop; never raises on I/O."""
    while True:
        try:
            heartbeat.beat(*state())
        except OSError:
            pass   # a full or read-only disk must not take the replica down; the file goes stale instead
        await asyncio.sleep(every_s)


def replica_identity() -> tuple[str, str]:
    """(deployment, replica id) of the Serve replica this runs in; ("local", "local") outside Serve."""
    try:  # Ray only here: the probe never calls it
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.deployment, ctx.replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return "local", "local"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check(directory: Path | None = None, stale_s: float = DEFAULT_STALE_S, now: float | None = None,
          alive: Callable[[int], bool] = _alive) -> list[str]:
    """Why this pod is not ready (an empty list: it is). Removes the files of processes that are gone."""
    directory = directory or ready_dir()
    now = time.time() if now is None else now
    problems = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue   # being replaced right now, or not ours
        if not alive(int(beat.get("pid", -1))):
            path.unlink(missing_ok=True)
            continue
        who = f"{beat.get('deployment')} replica {beat.get('replica')}"
        if beat.get("state") == ERRORED:
            problems.append(f"{who}: errored ({beat.get('detail') or 'its engine failed'})")
        elif now - float(beat.get("at", 0)) > stale_s:
            problems.append(f"{who}: no heartbeat for {now - float(beat.get('at', 0)):.0f} s")
    return problems


def main() -> int:
    problems = check(stale_s=float(os.environ.get(STALE_ENV) or DEFAULT_STALE_S))
    for p in problems:
        print(f"not ready: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
