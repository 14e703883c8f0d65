"""service/usage.py and engine/final_budget.py without an engine: the engine core's report rides a finished
output's kv_transfer_params, the frontend takes it off (a KV connector's params stay) and keeps it by
external id, and the engine replica puts it in the usage block of a whole response or a stream's usage
chunk, once."""

import json
from types import SimpleNamespace

from kvtier.engine import final_budget
from kvtier.service.usage import prompts_in, with_final_budget

TIGHT = {"budget": 256, "floor": 256, "policy": "random", "tightened": "preemption", "tightened_at": 700,
         "evicted_tokens": 412}


def _out(rid, finished=True, params=None):
    return SimpleNamespace(request_id=rid, finish_reason="stop" if finished else None, kv_transfer_params=params)


def test_reports_travel_from_the_scheduler_to_the_store_by_external_id():
    outs = [_out("cmpl-a-0-x1"), _out("cmpl-a-1-x2", params={"do_remote_decode": True}), _out("cmpl-b-0-x3", False)]
    final_budget.attach({0: SimpleNamespace(outputs=outs)}, {"cmpl-a-0-x1": TIGHT})
    assert outs[0].kv_transfer_params == {"kvtier": TIGHT}
    assert outs[1].kv_transfer_params == {"do_remote_decode": True, "kvtier": final_budget.FULL_REPORT}
    assert outs[2].kv_transfer_params is None                     # not finished: nothing attached
    states = {"cmpl-a-0-x1": SimpleNamespace(external_req_id="cmpl-a-0"),
              "cmpl-a-1-x2": SimpleNamespace(external_req_id="cmpl-a-1")}
    final_budget.take_from_outputs(states, outs)
    assert outs[0].kv_transfer_params is None and outs[1].kv_transfer_params == {"do_remote_decode": True}
    # a completion of two prompts: the one that ended smallest; taken once
    assert final_budget.pop("cmpl-a", choices=2) == TIGHT
    assert final_budget.pop("cmpl-a", choices=2) is None


def test_the_usage_block_of_a_response_and_of_a_streams_usage_chunk_carries_the_report():
    final_budget.take_from_outputs({}, [_out("chatcmpl-c", params={"kvtier": TIGHT})])
    whole = {"response": {"id": "chatcmpl-c", "choices": [{}], "usage": {"completion_tokens": 9}}}
    assert with_final_budget(whole, 1)["response"]["usage"] == {"completion_tokens": 9, "kvtier": TIGHT}

    final_budget.take_from_outputs({}, [_out("cmpl-d-0", params={"kvtier": final_budget.FULL_REPORT})])
    token = 'data: {"id":"cmpl-d","choices":[{"text":"x"}],"usage":{"completion_tokens":1}}'
    usage = 'data: {"id":"cmpl-d","choices":[],"usage":{"completion_tokens":2}}'
    text = with_final_budget(f"{token}\n\n{usage}\n\ndata: [DONE]\n\n", 1)
    events = text.split("\n\n")
    assert events[0] == token and events[2] == "data: [DONE]"       # token chunks are left as they are
    assert json.loads(events[1][len("data: "):])["usage"] == {"completion_tokens": 2, "kvtier": final_budget.FULL_REPORT}
    assert with_final_budget("data: {\"id\":\"x\",\"choices\":[{\"text\":\"y\"}]}\n\n", 1).count("kvtier") == 0


def test_prompts_in_a_completions_body():
    assert prompts_in({"prompt": "a"}) == 1 and prompts_in({"prompt": [1, 2, 3]}) == 1
    assert prompts_in({"prompt": ["a", "b"]}) == 2 and prompts_in({"prompt": [[1], [2], [3]]}) == 3
