"""Router metrics, in one place: routing decisions (by tier and reason), rejections (by status, reason and
the tier when one was chosen), per tier the tokens served, time to first token and per output token,
end-to-end latency and streams the client hung up on, and whether the router runs in open mode. Kept
in-process for `/v1/kvtier/stats` and, inside Ray, exported as Ray metrics under the names of
`kvtier.observability.catalog` (Ray adds the `ray_` prefix and `_total` to counters) on the cluster's
metrics export port.

Token counts come from the engine's `usage` (the router asks the engine for it on every stream and drops
the extra chunk when the client did not ask), so they count what finished requests returned; a stream
the client abandons counts in `cancelled`, not in tokens."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter as _Counter
from collections import defaultdict, deque
from typing import Any, Callable

from kvtier.observability.exporters import catalog_metric

from .first_token import SEGMENTS, SEND, summarize

TTFT_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
SEGMENT_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
TPOT_BOUNDARIES = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]
NO_TIER = "none"   # the `tier` of a rejection before any tier was chosen (auth, bad request, no tier fits)

_RAY_METRICS = {  # attribute -> (catalog name, histogram boundaries)
    "decisions": ("ray_kvtier_router_decisions_total", None),
    "rejections": ("ray_kvtier_router_rejections_total", None),
    "generation_tokens": ("ray_kvtier_router_generation_tokens_total", None),
    "prompt_tokens": ("ray_kvtier_router_prompt_tokens_total", None),
    "cancelled": ("ray_kvtier_router_cancelled_total", None),
    "final_budgets": ("ray_kvtier_router_final_budget_total", None),
    "tokens_evicted": ("ray_kvtier_router_tokens_evicted_total", None),
    "latency": ("ray_kvtier_router_request_latency_seconds", LATENCY_BOUNDARIES),
    "ttft": ("ray_kvtier_router_ttft_seconds", TTFT_BOUNDARIES),
    "ttft_segments": ("ray_kvtier_router_ttft_segment_seconds", SEGMENT_BOUNDARIES),
    "tpot": ("ray_kvtier_router_tpot_seconds", TPOT_BOUNDARIES),
    "open_mode": ("ray_kvtier_router_open_mode", None),
    "engine_healthy": ("ray_kvtier_router_engine_healthy", None),
    "engine_errored": ("ray_kvtier_router_engine_replicas_errored", None),
}
RECENT_BREAKDOWNS = 8192   # per-request first-token breakdowns kept for /v1/kvtier/stats?ttft_since=


def _ray_metrics() -> dict[str, Any] | None:
    """The router's Ray metrics, or None outside Ray (unit tests)."""
    import ray
    from ray.util import metrics

    if not ray.is_initialized():
        return None
    return {attr: catalog_metric(metrics, name, **({"boundaries": boundaries} if boundaries else {}))
            for attr, (name, boundaries) in _RAY_METRICS.items()}


class RouterMetrics:
    def __init__(self, export: bool = True):
        self._lock = threading.Lock()
        self.decisions: _Counter[tuple[str, str]] = _Counter()
        self.rejections: _Counter[tuple[int, str]] = _Counter()
        self.tiers: dict[str, _Counter[str]] = defaultdict(_Counter)
        self.final_budgets: _Counter[tuple[str, str]] = _Counter()   # (tier, K or "full") of finished requests
        self.breakdowns: deque[tuple[float, str, dict[str, float]]] = deque(maxlen=RECENT_BREAKDOWNS)
        self._ray: dict[str, Any] | None = None
        if export:
            try:
                self._ray = _ray_metrics()
            except Exception:  # metrics are best effort; routing must not depend on them
                self._ray = None

    def _inc(self, attr: str, value: float, tags: dict[str, str]) -> None:
        if self._ray and value > 0:
            self._ray[attr].inc(value, tags=tags)

    def _observe(self, attr: str, value: float, tags: dict[str, str]) -> None:
        if self._ray:
            self._ray[attr].observe(value, tags=tags)

    def decision(self, tier: str, reason: str) -> None:
        with self._lock:
            self.decisions[(tier, reason)] += 1
        self._inc("decisions", 1, {"tier": tier, "reason": reason})

    def rejection(self, status: int, reason: str, tier: str = NO_TIER) -> None:
        with self._lock:
            self.rejections[(status, reason)] += 1
        self._inc("rejections", 1, {"status": str(status), "reason": reason, "tier": tier})

    def keep_gauges(self, open_mode: bool, every_s: float,
                    engines: Callable[[], dict[str, tuple[bool, int]]] = dict) -> asyncio.Task:
        """Export the open-mode gauge (1: anyone may call every tier) and, per engine deployment, whether it
        can serve (1: a replica answers and is not errored) and how many replicas report an errored engine,
        every `every_s` on the running loop: Ray drops a gauge value that is not refreshed. `engines()`:
        deployment -> (healthy, errored replicas), read at each refresh."""
        async def refresh() -> None:
            while True:
                if self._ray:
                    self._ray["open_mode"].set(1.0 if open_mode else 0.0, tags={})
                    for deployment, (healthy, errored) in engines().items():
                        self._ray["engine_healthy"].set(1.0 if healthy else 0.0, tags={"deployment": deployment})
                        self._ray["engine_errored"].set(float(errored), tags={"deployment": deployment})
                await asyncio.sleep(every_s)
        return asyncio.get_running_loop().create_task(refresh())

    def first_token(self, tier: str, seconds: float) -> None:
        """First chunk of a stream (or the whole response) reached the client's connection."""
        self._observe("ttft", seconds, {"tier": tier})

    def first_token_segments(self, tier: str, segments: dict[str, float]) -> None:
        """Where one request's time to first token went inside the service (first_token.segments)."""
        with self._lock:
            self.breakdowns.append((time.time(), tier, segments))
        for name in SEGMENTS:
            self._observe("ttft_segments", segments[name], {"tier": tier, "segment": name})

    def first_chunk_sent(self, tier: str, segments: dict[str, float], seconds: float) -> None:
        """A stream's first chunk was sent `seconds` after the router got it (first_token.SEND), added to the
        request's segments (recorded by first_token_segments)."""
        with self._lock:
            segments[SEND] = max(0.0, seconds)
        self._observe("ttft_segments", max(0.0, seconds), {"tier": tier, "segment": SEND})

    def first_token_breakdown(self, since: float) -> dict[str, dict]:
        """Per tier and over all tiers ("all"), the segments' mean and p99 over the requests that arrived
        since `since` (unix time; the most recent RECENT_BREAKDOWNS only)."""
        with self._lock:
            recent = [(tier, seg) for t, tier, seg in self.breakdowns if t - seg["total"] >= since]
        out = {tier: summarize([seg for t, seg in recent if t == tier]) for tier in sorted({t for t, _ in recent})}
        return {**out, "all": summarize([seg for _, seg in recent])} if recent else {}

    def finished(self, tier: str, seconds: float, usage: dict | None, first_token_s: float | None = None) -> None:
        """A request answered in full; `usage` is the engine's OpenAI usage block (None: not reported);
        `first_token_s`: a stream's time to first token, for its time per output token."""
        prompt = int((usage or {}).get("prompt_tokens") or 0)
        generated = int((usage or {}).get("completion_tokens") or 0)
        with self._lock:
            t = self.tiers[tier]
            t["finished"] += 1
            t["prompt_tokens"] += prompt
            t["generation_tokens"] += generated
        tags = {"tier": tier}
        report = (usage or {}).get("kvtier")
        if isinstance(report, dict):      # the engine's final budget (service/usage.py)
            budget = "full" if report.get("budget") is None else str(report["budget"])
            evicted = int(report.get("evicted_tokens") or 0)
            with self._lock:
                self.final_budgets[(tier, budget)] += 1
                self.tiers[tier]["tokens_evicted"] += evicted
            self._inc("final_budgets", 1, {"tier": tier, "budget": budget})
            self._inc("tokens_evicted", evicted, tags)
        self._inc("prompt_tokens", prompt, tags)
        self._inc("generation_tokens", generated, tags)
        self._observe("latency", seconds, tags)
        if first_token_s is not None and generated >= 2:
            self._observe("tpot", max(0.0, seconds - first_token_s) / (generated - 1), tags)

    def cancelled(self, tier: str) -> None:
        """The client hung up on a stream; the engine request was aborted."""
        with self._lock:
            self.tiers[tier]["cancelled"] += 1
        self._inc("cancelled", 1, {"tier": tier})

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "decisions": [{"tier": t, "reason": r, "count": n} for (t, r), n in sorted(self.decisions.items())],
                "rejections": [{"status": s, "reason": r, "count": n} for (s, r), n in sorted(self.rejections.items())],
                "tiers": {tier: {k: c[k] for k in ("finished", "prompt_tokens", "generation_tokens", "cancelled",
                                                   "tokens_evicted")}
                          for tier, c in sorted(self.tiers.items())},
                "final_budgets": [{"tier": t, "budget": b, "count": n}
                                  for (t, b), n in sorted(self.final_budgets.items())],
            }
