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


def with_final_budget(item: str | dict[str, Any], prompts: int) -> str | dict[str, Any]:
    """`item` (a whole response {"response": body} or SSE text) with `usage.kvtier` added where it carries
    the usage block; anything else unchanged."""
    if isinstance(item, dict):
        body = item.get("response")
        if isinstance(body, dict) and isinstance(body.get("usage"), dict):
            body["usage"]["kvtier"] = final_budget.pop(str(body.get("id")), prompts)
        return item
    if '"usage":{' not in item and '"usage": {' not in item:
        return item
    events = item.split("\n\n")
    for i, event in enumerate(events):
        if not event.startswith("data: {") or ('"usage":{' not in event and '"usage": {' not in event):
            continue
        try:
            data = json.loads(event[len("data: "):])
        except ValueError:
            continue
        if isinstance(data.get("usage"), dict) and data.get("choices") == []:   # the stream's usage chunk
            data["usage"]["kvtier"] = final_budget.pop(str(data.get("id")), prompts)
            events[i] = "data: " + json.dumps(data, separators=(",", ":"))
    return "\n\n".join(events)
