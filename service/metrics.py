"""Router counters, in one place: routing decisions (by tier and reason) and rejections (by status and
reason). Kept in-process for `/v1/kvtier/stats` and, inside Ray, exported as Ray metrics (Prometheus
names get Ray's `ray_` prefix: `ray_kvtier_router_decisions_total{tier,reason}`,
`ray_kvtier_router_rejections_total{status,reason}`) on the cluster's metrics export port."""

from __future__ import annotations

import threading
from collections import Counter as _Counter

DECISIONS = "kvtier_router_decisions"
REJECTIONS = "kvtier_router_rejections"


class RouterMetrics:
    def __init__(self, export: bool = True):
        self._lock = threading.Lock()
        self.decisions: _Counter[tuple[str, str]] = _Counter()
        self.rejections: _Counter[tuple[int, str]] = _Counter()
        self._ray = None
        if export:
            try:
                import ray
                from ray.util import metrics

                if ray.is_initialized():
                    self._ray = (
                        metrics.Counter(DECISIONS, "Requests routed, by tier and reason.", tag_keys=("tier", "reason")),
                        metrics.Counter(REJECTIONS, "Requests rejected by the router, by HTTP status and reason.",
                                        tag_keys=("status", "reason")),
                    )
            except Exception:  # metrics are best effort; routing must not depend on them
                self._ray = None

    def decision(self, tier: str, reason: str) -> None:
        with self._lock:
            self.decisions[(tier, reason)] += 1
        if self._ray:
            self._ray[0].inc(1, tags={"tier": tier, "reason": reason})

    def rejection(self, status: int, reason: str) -> None:
        with self._lock:
            self.rejections[(status, reason)] += 1
        if self._ray:
            self._ray[1].inc(1, tags={"status": str(status), "reason": reason})

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "decisions": [{"tier": t, "reason": r, "count": n} for (t, r), n in sorted(self.decisions.items())],
                "rejections": [{"status": s, "reason": r, "count": n} for (s, r), n in sorted(self.rejections.items())],
            }
