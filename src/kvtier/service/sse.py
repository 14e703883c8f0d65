"""The router's side of a streamed response: relay the engine's SSE chunks to the client, take the token
usage from the engine's usage chunk (dropping that chunk unless the client asked for usage), end with
`data: [DONE]`, turn an engine failure mid-stream into an SSE error event, and cancel the engine request
when the client goes away (so its KV blocks are freed).
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from .errors import engine_failure, error_type
from .metrics import RouterMetrics
from .usage import usage_events


def take_usage(item: str, keep_usage_chunk: bool) -> tuple[str, dict | None]:
    """The usage block carried by a chunk of SSE events (the last one wins: usage is cumulative), and the
    text with the usage-only chunk (`"choices": []`) removed when the client did not ask for usage."""
    events, found = usage_events(item)
    if not found:
        return item, None
    dropped = set() if keep_usage_chunk else {i for i, data in found if data.get("choices") == []}
    return "\n\n".join(e for i, e in enumerate(events) if i not in dropped), found[-1][1]["usage"]


async def relay_stream(first, gen, engine: str, tier: str, t0: float, wants_usage: bool,
                       metrics: RouterMetrics, segments: dict[str, float] | None = None,
                       first_at: float | None = None) -> AsyncIterator[str]:
    """The client's SSE stream: `first` (the engine's first chunk, already received at unix time
    `first_at`), then the rest of `gen` (the engine's streaming call); the router's first-token, finished
    and cancelled counts, and the request's `send` segment (first_token.SEND) once a chunk went out."""
    done, usage, sent = False, None, False
    try:
        item = first
        ttft = time.perf_counter() - t0
        metrics.first_token(tier, ttft)
        while True:
            done = done or "data: [DONE]" in item
            item, found = take_usage(item, keep_usage_chunk=wants_usage)
            usage = found or usage
            if item:
                yield item   # resumes once the ASGI send of this chunk returned
                if not sent and segments is not None and first_at is not None:
                    metrics.first_chunk_sent(tier, segments, time.time() - first_at)
                sent = True
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                break
        if not done:
            yield "data: [DONE]\n\n"
            done = True
        metrics.finished(tier, time.perf_counter() - t0, usage, first_token_s=ttft)
    except Exception as exc:  # noqa: BLE001 - the engine died mid-stream: tell the client, then stop
        err = engine_failure(exc, engine)
        metrics.rejection(err.status, err.reason, tier)
        payload = {"error": {"message": err.message, "type": error_type(err.status), "code": err.status}}
        yield f"data: {json.dumps(payload)}\n\n"
        done = True
    finally:
        if not done:  # client went away: cancel the engine request so its KV blocks are freed
            gen.cancel()
            metrics.cancelled(tier)
