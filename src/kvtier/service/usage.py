"""What kvtier's engine replica adds to a response's `usage`: `usage.kvtier`, the request's final budget as
the engine reported it (engine/final_budget.py: budget, floor, policy, why and when it was tightened,
tokens evicted). An elastic request's budget is decided while it runs, so this is the one place a client
learns what it was served with; the router's `x-kvtier-tier` header says only where it was sent.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.engine import final_budget


def prompts_in(payload: dict[str, Any]) -> int:
    """How many prompts a completions body carries (each is its own engine request)."""
    prompt = payload.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def usage_events(item: str) -> tuple[list[str], list[tuple[int, dict[str, Any]]]]:
    """A chunk of SSE text split into its events, and (index, parsed JSON) of the events carrying a usage
    object (pydantic's compact JSON or json.dumps spacing); no parsing when no event can carry one."""
    if '"usage":{' not in item and '"usage": {' not in item:   # the common case: a token chunk, no usage
        return [item], []
    events, found = item.split("\n\n"), []
    for i, event in enumerate(events):
        if event.startswith("data: {") and ('"usage":{' in event or '"usage": {' in event):
            try:
                data = json.loads(event[len("data: "):])
            except ValueError:
                continue
            if isinstance(data.get("usage"), dict):
                found.append((i, data))
    return events, found


def with_final_budget(item: str | dict[str, Any], prompts: int) -> str | dict[str, Any]:
    """`item` (a whole response {"response": body} or SSE text) with `usage.kvtier` added where it carries
    the usage block; anything else unchanged."""
    if isinstance(item, dict):
        body = item.get("response")
        if isinstance(body, dict) and isinstance(body.get("usage"), dict):
            body["usage"]["kvtier"] = final_budget.pop(str(body.get("id")), prompts)
        return item
    events, found = usage_events(item)
    usage_chunks = [(i, data) for i, data in found if data.get("choices") == []]   # the stream's usage chunk
    if not usage_chunks:
        return item
    for i, data in usage_chunks:
        data["usage"]["kvtier"] = final_budget.pop(str(data.get("id")), prompts)
        events[i] = "data: " + json.dumps(data, separators=(",", ":"))
    return "\n\n".join(events)
