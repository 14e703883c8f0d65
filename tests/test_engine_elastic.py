"""Elastic budgets on the vLLM engine (issue #37 item 1, engine/elastic.py): elastic requests run at full
attention and are tightened to their floor, once, when the pool runs short; the tightened keep-sets are
exactly the masked reference's; a KV-bound batch runs without preemption while its floors fit and is
preempted by vLLM only once they do not. Tiny Qwen3 on CPU, an 11-block pool (128-token blocks)."""

import pytest

pytest.importorskip("vllm")

from engine_helpers import PROMPTS, assert_matches_masked_reference, greedy, records_for  # noqa: E402
from kvtier.engine import final_budget  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats, pool_state  # noqa: E402
from kvtier.engine.elastic import Candidate, choose  # noqa: E402
from kvtier.engine.support import KVTierRequestError  # noqa: E402

BUFFER, FLOOR, TOKENS = 16, 200, 320     # a floor's request holds <= ceil((200 + 32) / 128) = 2 blocks


@pytest.fixture(scope="module")
def engines():
    return []


def _engine(tiny_model_dir, engines, admission, audit=None):
    llm = build_llm(tiny_model_dir, eviction={"default": {"buffer": BUFFER}, "admission": admission,
                                              **({"audit_log": audit} if audit else {})},
                    kv_cache_bytes=3 << 20, max_model_len=1024, max_num_seqs=16, enforce_eager=True)
    engines.append(llm)
    return llm


def _batch(llm, n, logprobs=None):
    return llm.generate([PROMPTS[0] + f" request {i}" for i in range(n)],
                        [greedy(TOKENS, logprobs=logprobs, budget="elastic", floor=FLOOR, seed=i) for i in range(n)],
                        use_tqdm=False)


def test_choose_takes_the_fewest_largest_first():
    c = [Candidate("a", 5, 2), Candidate("b", 9, 2), Candidate("c", 4, 2), Candidate("d", 2, 2)]
    assert choose(c, 0) == [] and choose(c, -3) == []
    assert choose(c, 7) == ["b"]                          # one request frees 7
    assert choose(c, 8) == ["b", "a"]                     # largest first: 7 + 3
    assert choose(c, 100) == ["b", "a", "c"]              # all that free a block ("d" frees none)
    assert choose(c, 100, all_or_nothing=True) == []      # admission: nothing when it cannot fit anyway


def test_kv_bound_elastic_batch_tightens_instead_of_preempting_and_matches_the_reference(tiny_model_dir, tmp_path,
                                                                                        replay, engines):
    """5 requests whose full traces need 15 blocks in an 11-block pool, floors 10: every one is tightened
    (at its floor's catch-up round, K + 2r entries or more), none is preempted, all finish, every block
    comes back; a tightened request's log-probs are the masked reference's under its logged keep-sets, and
    without the masks they differ."""
    audit = str(tmp_path / "keep.jsonl")
    llm = _engine(tiny_model_dir, engines, "reserve", audit)
    outs = _batch(llm, 5, logprobs=0)
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outs)
    st = eviction_stats(llm)["engine"]
    assert st["preemptions_compressed"] == 0
    assert sum(st["tightenings"].values()) >= 1 and st["tokens_evicted_under_pressure"] > 0
    tightened = [o for o in outs if records_for(audit, o.request_id)]
    assert tightened, "no request was tightened"
    for o in tightened:
        recs = records_for(audit, o.request_id)
        first = recs[0]
        assert first["round"] == 1 and first["budget"] == FLOOR
        assert first["query_position"] + 1 >= FLOOR + 2 * BUFFER         # tightened from full attention
        assert all(len(head) == FLOOR for layer in first["kept"] for head in layer)
    for o in outs:   # each request's final budget, as the engine reported it (final_budget.py)
        assert o.kv_transfer_params is None          # taken off again: vLLM's own output is unchanged
        report = final_budget.pop(o.request_id)
        if o in tightened:
            first = records_for(audit, o.request_id)[0]
            assert report["budget"] == FLOOR and report["tightened"] in ("preemption", "admission"), report
            assert report["tightened_at"] == first["query_position"] + 1 and report["evicted_tokens"] > 0, report
        else:
            assert report["budget"] is None and report["tightened"] is None and report["evicted_tokens"] == 0
        assert report["floor"] == FLOOR and report["policy"] == "random", report
    for o in tightened[:2]:
        assert_matches_masked_reference(replay, o, records_for(audit, o.request_id), BUFFER, what="elastic: ")
    assert pool_state(llm)["free_blocks"] == pool_state(llm)["total_blocks"]


def test_an_elastic_request_with_room_is_full_attention(tiny_model_dir, engines):
    """Alone in the pool an elastic request is never tightened: token-identical to full attention."""
    llm = engines[0] if engines else _engine(tiny_model_dir, engines, "reserve")
    before = sum(eviction_stats(llm)["engine"]["tightenings"].values())
    elastic = llm.generate(PROMPTS[:1], greedy(TOKENS, budget="elastic", floor=FLOOR), use_tqdm=False)[0]
    full = llm.generate(PROMPTS[:1], greedy(TOKENS, budget="full"), use_tqdm=False)[0]
    assert list(elastic.outputs[0].token_ids) == list(full.outputs[0].token_ids)
    assert sum(eviction_stats(llm)["engine"]["tightenings"].values()) == before
    assert final_budget.pop(elastic.request_id) == {**final_budget.FULL_REPORT, "floor": FLOOR, "policy": "random"}
    assert final_budget.pop(full.request_id) == final_budget.FULL_REPORT


def test_floors_that_do_not_fit_fall_back_to_vllm_preemption(tiny_model_dir, engines):
    """Stock admission and 8 requests whose floors need 16 blocks of 11: tightening cannot free enough, so
    vLLM preempts (and recomputes) some; every request still completes and the pool comes back."""
    llm = _engine(tiny_model_dir, engines, "vllm")
    outs = _batch(llm, 8)
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outs)
    st = eviction_stats(llm)["engine"]
    assert st["preemptions_compressed"] >= 1 and sum(st["tightenings"].values()) >= 1
    assert pool_state(llm)["free_blocks"] == pool_state(llm)["total_blocks"]


@pytest.mark.parametrize("args, names", [
    ({"budget": "elastic"}, "kvtier_floor"),                                   # no floor
    ({"budget": 256, "floor": 128}, "kvtier_floor"),                           # a floor on a fixed budget
    ({"budget": "elastic", "floor": 256, "policy": "rkv"}, "kvtier_policy"),   # reads queries from the start
    ({"budget": "elastic", "floor": 8}, "budget=8"),                           # below the protected prompt
])
def test_bad_elastic_requests_are_refused_by_name(tiny_model_dir, engines, args, names):
    llm = engines[0] if engines else _engine(tiny_model_dir, engines, "reserve")
    with pytest.raises(KVTierRequestError, match=names):
        llm.generate(PROMPTS[:1], greedy(8, **args), use_tqdm=False)
    assert len(llm.generate(PROMPTS[1:2], greedy(8), use_tqdm=False)[0].outputs[0].token_ids) == 8
