"""Policy failures cost one request, never the engine; seeds are per request and per global KV head."""

import pytest
import torch

pytest.importorskip("vllm")

from engine_helpers import engine_logprobs, greedy, records_for  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats, pool_state  # noqa: E402
from kvtier.policies import EvictionPolicy  # noqa: E402
from kvtier.policies.base import KEYS  # noqa: E402
from kvtier.policies.keyed_random import keyed_subsets, row_keys, seed_key  # noqa: E402
from kvtier.policies.registry import register  # noqa: E402

pytestmark = pytest.mark.engine

BUFFER = 16
PROMPT = "Let x = 42. Then the answer is \\boxed{x} and we continue to reason about it " * 2


class _ExplodingPolicy(EvictionPolicy):
    """Reads keys like a scored policy, then raises at its first round (a policy bug in production)."""

    name = "_test_exploding"
    needs = frozenset({KEYS})

    def score(self, ctx):
        raise RuntimeError("scoring exploded")


@pytest.fixture(scope="module", autouse=True)
def exploding_policy():
    """Registered for this module only (benchmarks iterate every registered policy)."""
    from kvtier.policies.registry import _REGISTRY

    register(_ExplodingPolicy)
    yield
    _REGISTRY.pop(_ExplodingPolicy.name, None)


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit") / "keep.jsonl")


@pytest.fixture(scope="module")
def llm(tiny_model_dir, audit_path):
    return build_llm(tiny_model_dir, eviction={"default": {"buffer": BUFFER}, "audit_log": audit_path},
                     kv_cache_bytes=16 << 20, max_model_len=1024, max_num_seqs=16, enforce_eager=True)


def kept_sets(audit_path, request_id):
    return [r["kept"] for r in records_for(audit_path, request_id) if "kept" in r]


def test_failing_policy_aborts_its_request_only(llm, audit_path, replay):
    before = pool_state(llm)
    failures_before = eviction_stats(llm)["engine"]["policy_failures"]
    params = [greedy(240, logprobs=0, budget=96, seed=1), greedy(240, budget=96, policy="_test_exploding"),
              greedy(240, logprobs=0, budget=64, policy="snapkv")]
    outs = llm.generate([PROMPT, PROMPT + " b", PROMPT + " c"], params, use_tqdm=False)
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and len(bad.token_ids) < 240
    assert eviction_stats(llm)["engine"]["policy_failures"] == failures_before + 1
    for out in (outs[0], outs[2]):
        assert len(out.outputs[0].token_ids) == 240 and out.outputs[0].finish_reason == "length"
        recs = records_for(audit_path, out.request_id)
        assert len([r for r in recs if "kept" in r]) >= 3
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        err = (engine_logprobs(out) - replay.logprobs(ids, len(out.prompt_token_ids), recs, BUFFER)).abs()
        assert err.max() < 0.06, err.max()
    assert pool_state(llm)["free_blocks"] == before["free_blocks"]
    again = llm.generate([PROMPT], [greedy(200, budget=64)], use_tqdm=False)[0].outputs[0]
    assert len(again.token_ids) == 200 and again.finish_reason == "length"


def test_seeded_keep_sets_do_not_depend_on_the_batch(llm, audit_path):
    alone = llm.generate([PROMPT], [greedy(200, budget=64, seed=11)], use_tqdm=False)[0]
    crowd = llm.generate([PROMPT + " x", PROMPT, PROMPT + " y"],
                         [greedy(260, budget=80, seed=3), greedy(200, budget=64, seed=11), greedy(200, budget=64)],
                         use_tqdm=False)
    a, b = kept_sets(audit_path, alone.request_id), kept_sets(audit_path, crowd[1].request_id)
    assert len(a) >= 3 and a == b
    assert kept_sets(audit_path, crowd[2].request_id) != a   # unseeded: OS entropy, not a fixed stream


def test_worker_leaves_global_torch_generators_alone(llm):
    """The worker never reseeds torch's global generators (vLLM's unseeded sampling draws from them)."""
    seed = torch.initial_seed()
    llm.generate([PROMPT, PROMPT + " z"], [greedy(120, budget=64), greedy(120, budget=64, policy="snapkv")],
                 use_tqdm=False)
    assert torch.initial_seed() == seed


def test_tensor_parallel_ranks_draw_the_heads_of_one_unsharded_draw():
    """Row keys use the global KV head index: rank r (heads [r*H, (r+1)*H)) draws exactly what a single
    rank holding all 2H heads draws for those heads, so TP changes nothing but who computes what."""
    req, rounds, L, H = torch.tensor([seed_key(7)]), torch.tensor([3]), 4, 2
    whole = row_keys(req, rounds, L, torch.arange(2 * H)).reshape(-1, 2 * H)
    for rank in range(2):
        part = row_keys(req, rounds, L, torch.arange(H) + rank * H).reshape(-1, H)
        assert torch.equal(part, whole[:, rank * H:(rank + 1) * H])
    low, high = torch.full((whole.numel(),), 10), torch.full((whole.numel(),), 90)
    victims = keyed_subsets(whole.reshape(-1), low, high, 16, 90).view(L, 2 * H, 16)
    assert not torch.equal(victims[:, 0], victims[:, H])       # heads differ across ranks too
    assert not torch.equal(row_keys(req, rounds + 1, L, torch.arange(H)), row_keys(req, rounds, L, torch.arange(H)))
