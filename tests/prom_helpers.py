"""Helpers for the live-Prometheus tests: dashboard PromQL as Grafana sends it, and polling."""

from __future__ import annotations

import re
import time

WINDOW = "10m"   # $__rate_interval: each live test's load fits in it


def expand(expr: str) -> str:
    """A panel's PromQL with Grafana's variables as a dashboard set to 'All' sends them."""
    expr = expr.replace("$__rate_interval", WINDOW)
    return re.sub(r"\$\{?(namespace|cluster|deployment|tier)\}?", ".*", expr)


def wait_for(what: str, check, timeout: float = 90):
    """Poll until check() returns a truthy value (Ray exports and Prometheus scrapes every second here)."""
    t0, last = time.time(), None
    while time.time() - t0 < timeout:
        try:
            last = check()
            if last:
                return last
        except (AssertionError, TypeError) as exc:  # a value not there yet
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what}: not satisfied after {timeout} s (last: {last})")


def settled(prom, exprs: list[str], quiet_s: float = 4, timeout: float = 60) -> dict[str, float]:
    """The values of exprs once none has changed for quiet_s (everything done so far is exported), waited
    for together."""
    t0 = time.time()
    values, since = {e: prom.value(e) for e in exprs}, time.time()
    while time.time() - t0 < timeout:
        time.sleep(1)
        now = {e: prom.value(e) for e in exprs}
        if now != values:
            values, since = now, time.time()
        elif time.time() - since >= quiet_s:
            return {e: v or 0.0 for e, v in values.items()}
    raise AssertionError(f"{exprs} did not settle in {timeout} s")


def empty_panel_queries(prom, queries, timeout: float = 60) -> list[tuple[str, str]]:
    """(title, expanded expr) of every query that still returns no series after `timeout` s (a PromQL error
    raises). Polled: a rate() has data only from a counter's second scraped sample, and Ray and Serve
    export some counters (preemptions, HTTP errors) only on their 10 s cadence after the first event."""
    t0 = time.time()
    while True:
        empty = [(title, expand(expr)) for title, expr in queries if not prom.query(expand(expr))]
        if not empty or time.time() - t0 >= timeout:
            return empty
        queries = [(t, e) for t, e in queries if (t, expand(e)) in empty]
        time.sleep(2)


def wait_deltas(prom, before: dict[str, float], expected: dict[str, float], timeout: float = 60) -> None:
    """Wait until every expression moved from `before` by exactly `expected`; report the last deltas."""
    t0, deltas = time.time(), {}
    while time.time() - t0 < timeout:
        deltas = {e: (prom.value(e) or 0.0) - before[e] for e in expected}
        if deltas == expected:
            return
        time.sleep(1)
    raise AssertionError(f"deltas {deltas} != expected {expected} after {timeout} s")


def ray_histogram_sum(values, boundaries) -> float:
    """The `_sum` Ray 2.60 exports for these observations: each counts as its bucket's midpoint (the first
    bucket's lower edge is 0; +Inf counts as twice the last boundary)."""
    edges = [0.0, *boundaries]
    total = 0.0
    for v in values:
        i = next((k for k, b in enumerate(boundaries) if v <= b), None)
        total += 2.0 * boundaries[-1] if i is None else (edges[i] + edges[i + 1]) / 2.0
    return total
