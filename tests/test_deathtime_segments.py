"""Samples generated on several caches (kvtier.deathtime.segments): a segment that starts at the prompt is the
plain derivation; a preempted request's recomputed segments equal the engine's audit log, segment by segment
(the cache rebuilt with every entry visible, decode steps counted from the prompt, round numbers continued);
a multi-call sample collapses to one death tensor only when no earlier call evicted."""

from __future__ import annotations

import pytest
import torch

from kvtier.deathtime import NEVER, deaths_from_rounds, simulate_deaths
from kvtier.deathtime.segments import Segment, collapses, one_tensor_deaths, segment_deaths
from kvtier.policies import EvictionSchedule, make_policy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_a_segment_from_the_prompt_is_the_plain_derivation():
    seg = Segment(start=20, end=150, prompt_len=20, seed=5, budget=24, buffer=8)
    plain = simulate_deaths(make_policy("random"), EvictionSchedule(24, 8), 20, 150, num_layers=4, num_kv_heads=2,
                            seed=5)
    assert torch.equal(segment_deaths(seg, 150, 4, 2), plain) and (plain != NEVER).any()


def test_a_rebuilt_cache_sees_everything_then_catches_up_with_continued_round_numbers():
    """After a recompute at 100 tokens (K + 2r = 40 reached at once) the first round runs before feeding
    position 100 and kills everything but K + r entries; every death is at or after the rebuild; the keyed
    draw of round 1 + rounds_before differs from round 1's."""
    seg = Segment(start=100, end=150, prompt_len=20, seed=5, budget=24, buffer=8, rounds_before=9)
    d = segment_deaths(seg, 150, 4, 2)
    assert seg.rounds()[0] == 99 and int(d[d != NEVER].min()) == 100
    assert ((d[:, :, :100] == 100).sum(-1) == 100 - 32).all()          # all but K + r of 100 die at the catch-up
    fresh = segment_deaths(Segment(**{**seg.__dict__, "rounds_before": 0}), 150, 4, 2)
    assert not torch.equal(d, fresh)


def test_a_multi_call_sample_collapses_only_when_no_earlier_call_evicted():
    last = Segment(start=90, end=199, prompt_len=90, seed=2, budget=24, buffer=8, policy_params='{"protect_prefix": 20}')
    quiet = Segment(start=20, end=30, prompt_len=20, seed=1, budget=24, buffer=8)         # 30 < K + r: no round
    busy = Segment(start=20, end=80, prompt_len=20, seed=1, budget=24, buffer=8)
    assert collapses([quiet, last]) and not collapses([busy, last])
    assert torch.equal(one_tensor_deaths([quiet, last], 200, 4, 2), segment_deaths(last, 200, 4, 2))
    assert one_tensor_deaths([busy, last], 200, 4, 2) is None


@pytest.mark.engine
@pytest.mark.parametrize("budget", [300, 100])
def test_preempted_requests_segments_equal_the_engines_audit_log(tiny_model_dir, tmp_path, engines, budget):
    """Stock admission in an 11-block pool preempts compressed `random` requests mid-generation (K = 300:
    before their first round; K = 100: a bound of K + 2r = 132 entries needs a second 128-token block after
    rounds ran); for each preempted one, every segment between recomputes (the first from the prompt, each
    later one from its reset row + 1 with the rounds logged before it) derives exactly the audit log's rounds
    of that segment."""
    from engine_helpers import PROMPTS, greedy, records_for

    from kvtier.engine.api import build_llm

    audit = str(tmp_path / "keep.jsonl")
    llm = build_llm(tiny_model_dir, eviction={"default": {"policy": "random", "buffer": 16}, "admission": "vllm",
                                              "audit_log": audit},
                    kv_cache_bytes=3 << 20, max_model_len=1024, max_num_seqs=16, enforce_eager=True)
    engines.append(llm)
    prompts = [PROMPTS[0] + f" request {i}" for i in range(6)]
    outs = llm.generate(prompts, [greedy(400, budget=budget, seed=i) for i in range(6)], use_tqdm=False)
    checked = after_rounds = 0
    for seed, out in enumerate(outs):
        recs = records_for(audit, out.request_id)
        resets = sorted(int(r["reset_row"]) for r in recs if "reset_row" in r)
        if not resets:
            continue
        plen = len(out.prompt_token_ids)
        n = plen + len(out.outputs[0].token_ids)
        kept = [r for r in recs if "kept" in r]
        bounds = [plen] + [row + 1 for row in resets] + [n]          # each segment's start; rows [start - 1, end)
        for start, nxt in zip(bounds, bounds[1:]):
            end = nxt - 1 if nxt < n else n
            logged = [r for r in kept if start <= r["query_position"] + 1 < end + (nxt == n)]
            before = sum(r["query_position"] + 1 < start for r in kept)
            seg = Segment(start=start, end=end, prompt_len=plen, seed=seed, budget=budget, buffer=16,
                          rounds_before=before)
            want = deaths_from_rounds(logged, 4, 2, n, 16)
            assert torch.equal(segment_deaths(seg, n, 4, 2), want), (out.request_id, start)
            assert [r["round"] for r in logged] == list(range(before + 1, before + 1 + len(logged)))
            checked += 1
            after_rounds += start > plen and before > 0
    assert checked >= 2, "no request was preempted"
    assert after_rounds >= (1 if budget == 100 else 0), "no recompute after a round: the case is not exercised"


@pytest.fixture(scope="module")
def engines():
    return []
