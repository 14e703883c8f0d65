"""Where a request's time to first token goes inside the service: timestamps at every hop the router can
see, as named segments (seconds).

    route       router received the request -> tier chosen (auth, prompt tokens counted, routing rule)
    to_replica  tier chosen -> the engine replica received the call (Ray handle, scheduling, transfer)
    engine      replica received -> vLLM's first chunk left the replica (Ray Serve LLM's OpenAI layer,
                vLLM's tokenisation, add_request, queueing, prefill, the first token, detokenisation)
    to_router   first chunk left the replica -> the router holds it (Ray's streaming return)

`total` is their sum, router arrival to first chunk. After it, for streams:

    send        the router holds the first chunk -> its ASGI send returned (Starlette's streaming response,
                then Serve's hand-off to its proxy, or with direct ingress uvicorn's socket write)

What lies outside (client -> Serve's proxy ->
router, and the first chunk router -> proxy -> client) is the client's TTFT minus `total` (`kvtier bench
serve` reports it as `proxy_and_http`). Timestamps are `time.time()` of the processes involved: exact on
one host, subject to clock skew (NTP: ~1 ms) across nodes. No vLLM or Ray import here: the router uses it.
"""

from __future__ import annotations

import time
from typing import Any

SEGMENTS = ("route", "to_replica", "engine", "to_router")
SEND = "send"   # recorded once a stream's first chunk is sent: not part of `total`
FIRST_KEY = "kvtier_first"


def first_item(item: Any, received: float) -> dict[str, Any]:
    """The replica's first answer wrapped with its timestamps: `received` when the call reached the replica,
    `first_out` when vLLM's first chunk (or whole response, or error) left it."""
    return {FIRST_KEY: item, "timing": {"replica_in": received, "first_out": time.time()}}


def unwrap_first(item: Any) -> tuple[Any, dict[str, float]]:
    """(the replica's first answer, its timestamps); an unwrapped item has none."""
    if isinstance(item, dict) and FIRST_KEY in item:
        return item[FIRST_KEY], item.get("timing") or {}
    return item, {}


def segments(router_in: float, decided: float, replica: dict[str, float], router_first: float) -> dict[str, float]:
    """The named segments of one request (seconds; each >= 0, clock skew clipped), `total` included. Without
    the replica's timestamps the replica's share is folded into `engine`."""
    replica_in = replica.get("replica_in", decided)
    first_out = replica.get("first_out", router_first)
    out = {"route": decided - router_in, "to_replica": replica_in - decided, "engine": first_out - replica_in,
           "to_router": router_first - first_out}
    out = {k: max(0.0, v) for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def summarize(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per segment (and total): mean and p99 in milliseconds, and the count."""
    out: dict[str, dict[str, float]] = {}
    for name in (*SEGMENTS, "total", SEND):
        values = sorted(s[name] for s in samples if name in s)
        if values:
            p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
            out[name] = {"mean_ms": round(1e3 * sum(values) / len(values), 2), "p99_ms": round(1e3 * p99, 2),
                         "n": len(values)}
    return out
