"""Per-tenant request rate limits (`tenants.<name>.rate_limit`): a token bucket per tenant in each router
replica, so with N router replicas a tenant gets up to N times its rate (Serve spreads requests over them).

Pure (no Ray, no I/O); the router answers a refused request 429 with `retry-after` (errors.py's body)."""

from __future__ import annotations

import math
import time
from typing import Callable

from .config import ServiceConfig


class RateLimiter:
    """`wait(tenant)`: None when the tenant may send a request now (and it is counted), else the seconds
    until it may."""

    def __init__(self, cfg: ServiceConfig, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._limits = {name: (t.rate_limit.requests_per_s, float(t.rate_limit.burst))
                        for name, t in cfg.tenants.items() if t.rate_limit is not None}
        self._buckets: dict[str, tuple[float, float]] = {}   # tenant -> (tokens, at)

    def wait(self, tenant: str) -> float | None:
        limit = self._limits.get(tenant)
        if limit is None:
            return None
        rate, burst = limit
        now = self._clock()
        tokens, at = self._buckets.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        if tokens >= 1.0:
            self._buckets[tenant] = (tokens - 1.0, now)
            return None
        self._buckets[tenant] = (tokens, now)
        return (1.0 - tokens) / rate


def retry_after(seconds: float) -> str:
    """The `retry-after` header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
