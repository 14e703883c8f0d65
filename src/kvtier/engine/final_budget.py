"""A request's final budget, from the engine core to the response's `usage`.

An elastic request's budget is decided while it runs (scheduler_side.relieve), so only the engine knows
what a request ended with. The scheduler reports it on the request's last `EngineCoreOutput`, under
`kv_transfer_params["kvtier"]` (the one per-request dict vLLM 0.31 carries from the engine core to the
frontend; kvtier adds its key beside any KV connector's), and the frontend takes it off again before vLLM
builds the `RequestOutput`, so vLLM's own responses are unchanged. The frontend keeps the reports of the
latest finished requests by their external id (what the OpenAI server names the request) for the server
that answers them: kvtier's engine replica puts it in `usage.kvtier` (service/engine_server.py).

A report: {"budget": K or None (full attention at the end), "floor": K_min or None, "policy": name or None,
"tightened": why or None ("preemption" / "admission"), "tightened_at": the token count at the tightening
or None, "evicted_tokens": tokens evicted from the cache (per KV head)}.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

KEY = "kvtier"
FULL_REPORT: dict[str, Any] = {"budget": None, "floor": None, "policy": None, "tightened": None,
                               "tightened_at": None, "evicted_tokens": 0}
KEPT = 4096      # reports the frontend holds for servers that have not asked (aborted or never-asked requests)

_FINISHED: OrderedDict[str, dict[str, Any]] = OrderedDict()


def report(spec, offset: int, tightened: str | None, tightened_at: int | None) -> dict[str, Any]:
    """A request's report from its spec at the end (engine.config.EvictionSpec) and its offset."""
    return {"budget": spec.budget, "floor": spec.floor, "policy": spec.policy_name if spec.compressed or spec.elastic
            else None, "tightened": tightened, "tightened_at": tightened_at, "evicted_tokens": offset}


def attach(outputs, finished: dict[str, dict[str, Any]]) -> None:
    """Engine core: put each finished request's report (`finished`, by request id; full attention if none)
    on its last output in `outputs` (update_from_output's {client: EngineCoreOutputs})."""
    for batch in outputs.values():
        for out in batch.outputs:
            if out.finish_reason is not None:
                out.kv_transfer_params = {**(out.kv_transfer_params or {}),
                                          KEY: finished.get(out.request_id) or dict(FULL_REPORT)}


def take_from_outputs(request_states, outputs) -> None:
    """Frontend: move the reports off `outputs` (a list of EngineCoreOutput) into the store, keyed by the
    request's external id (`request_states`: the OutputProcessor's, by internal id)."""
    for out in outputs:
        params = out.kv_transfer_params
        if out.finish_reason is None or not params or KEY not in params:
            continue
        rest = {k: v for k, v in params.items() if k != KEY}
        out.kv_transfer_params = rest or None
        state = request_states.get(out.request_id)
        _FINISHED[getattr(state, "external_req_id", None) or out.request_id] = params[KEY]
        while len(_FINISHED) > KEPT:
            _FINISHED.popitem(last=False)


def pop(response_id: str, choices: int = 1) -> dict[str, Any] | None:
    """The report of the request an OpenAI response `response_id` answered, taken from the store: the
    request itself or its per-prompt requests (`<id>-<i>` for completions, `<id>_<i>` for chat; with
    several, the one that ended smallest; `choices`: how many prompts). None if the engine reported nothing."""
    keys = [response_id] + [f"{response_id}{sep}{i}" for i in range(max(choices, 1)) for sep in "-_"]
    found = [r for key in keys if (r := _FINISHED.pop(key, None)) is not None]
    if not found:
        return None
    return min(found, key=lambda r: (r["budget"] is None, r["budget"] or 0))
