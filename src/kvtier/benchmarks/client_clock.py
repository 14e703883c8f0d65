"""The benchmark client's own clock: when it could not run, and its CPU priority.

Why: on a small box the load generator shares the cores with the servers it measures. Measured on a 2-core
VM (docs/serving.md, "Fifth pass"): with kvtier's direct ingress the router sent every request's first chunk
135-147 ms after the client's POST, yet the client read one or two of 64 a further 200-240 ms later,
while a thread in the client woke 264-366 ms late having used ~0 CPU: the client process was not scheduled.
A p99 over 64 requests is its worst request or two, so such a stall decides the idle p99. `StallWatch`
reports these stalls per arm (so a reader can tell the client's from the server's), and `client_priority`
raises the client's priority when asked (`kvtier bench serve --client-nice`), for every arm alike.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")
AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


class StallWatch:
    """A daemon thread that sleeps `period_s` at a time and records each wake-up later than `min_lag_s`:
    the time this process (or, with the GIL held elsewhere in it, this thread) could not run.

    Use as a context manager around the measured work; `summary()` then returns
    {"stalls": n, "max_ms": ..., "total_ms": ..., "descheduled_ms": ...}, where `descheduled_ms` sums the
    stalls during which the process used under half the stall's length in CPU (not its own GIL holder or
    GC: the kernel gave the CPU to someone else)."""

    def __init__(self, period_s: float = 0.01, min_lag_s: float = 0.05):
        self.period_s, self.min_lag_s = period_s, min_lag_s
        self.stalls: list[tuple[float, float]] = []   # (lag s, process CPU s during it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvtier-stall-watch", daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            wall, cpu = time.perf_counter(), time.process_time()
            time.sleep(self.period_s)
            lag = time.perf_counter() - wall - self.period_s
            if lag > self.min_lag_s:
                self.stalls.append((lag, time.process_time() - cpu))

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        lags = [lag for lag, _ in self.stalls]
        away = [lag for lag, cpu in self.stalls if cpu < lag / 2]
        return {"stalls": len(lags), "max_ms": round(1000 * max(lags, default=0.0), 1),
                "total_ms": round(1000 * sum(lags), 1), "descheduled_ms": round(1000 * sum(away), 1)}


def streams_read_in_one_burst(ttfts: list, itls: list[list[float]], min_spread_s: float = 0.001) -> int:
    """How many of a benchmark's streams (vLLM's per-request `ttfts` and `itls`) reached the client all at
    once: more than one chunk, yet the last within `min_spread_s` of the first. Such a stream's TPOT is ~0
    and no measurement: while the engine generated it, the client (or a hop of the serving path) was not
    scheduled and the stream waited in a socket or a queue (seen once in CI: an arm with TPOT 0.00 ms)."""
    return sum(1 for t, itl in zip(ttfts, itls) if t is not None and itl and sum(itl) < min_spread_s)


def _autogroup_on(autogroup: Path, switch: Path) -> bool:
    return switch.exists() and switch.read_text().strip() == "1" and autogroup.exists()


@contextlib.contextmanager
def client_priority(nice: int | None, autogroup: Path = AUTOGROUP, switch: Path = AUTOGROUP_SWITCH):
    """Run the body with this process at `nice` (-20..0: only ever more urgent, so restoring is never refused)
    against the servers it measures; yields how
    ("autogroup nice -10", "thread nice -10"; None when `nice` is None: nothing changed), and restores the
    previous value after.

    With the kernel's autogroup scheduling on (the default on many kernels) a nice value only orders a
    process within its session, and the servers run in sessions of their own (servers.py starts them with
    start_new_session), so this session's autogroup gets `nice` (everything else in the session too, for
    the body's length). Without autogroup the calling thread gets it (vLLM's benchmark runs on it; threads
    it starts inherit it); servers are started outside the body, so they do not. A negative value needs
    root or CAP_SYS_NICE: PermissionError then, naming the option."""
    if nice is None:
        yield None
        return
    if not -20 <= nice <= 0:
        raise ValueError(f"--client-nice {nice}: expected -20..0 (the client is only ever made more urgent)")
    grouped = _autogroup_on(autogroup, switch)
    try:
        if grouped:
            before = int(autogroup.read_text().split("nice")[-1])
            autogroup.write_text(str(nice))
        else:
            before = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError as e:
        raise PermissionError(f"--client-nice {nice}: not permitted here ({e}); a negative value needs root or "
                              "CAP_SYS_NICE") from None
    try:
        yield f"{'autogroup' if grouped else 'thread'} nice {nice}"
    finally:   # back to where it was (a higher value never needs privilege)
        if grouped:
            autogroup.write_text(str(before))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, before)
