"""The transformers reference engine (kvtier.reference): plain greedy decoding without eviction, and the
masked-attention replay after rounds (its keep-sets against the vLLM engine's: tests/test_eval.py).

CPU, tiny Qwen3; torch runs single-threaded here (the CI machine has 2 shared cores).
"""

import pytest
import torch

from kvtier.engine.config import EvictionSpec
from kvtier.reference import MaskedReplay, Request, round_schedule

PROMPTS = [list(range(10, 40)), list(range(100, 117)), list(range(200, 251))]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_reference_engine_without_eviction_reproduces_transformers_greedy(ref, tiny_model_dir):
    """K >= length (no round is ever due) and full attention, batched with different prompt lengths:
    token-identical to plain transformers greedy generation of each prompt alone."""
    from transformers import AutoModelForCausalLM

    n = 40
    specs = [EvictionSpec(policy="random", budget=4000, buffer=16), EvictionSpec(budget=None),
             EvictionSpec(policy="snapkv", budget=500, buffer=64)]
    outs = ref.generate([Request(p, s, max_new_tokens=n) for p, s in zip(PROMPTS, specs)])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == g[0, len(p):].tolist()
        assert o.rounds == 0 and o.finish_reason == "length"


def test_reference_engine_attention_after_rounds_equals_masked_full_attention(ref, tiny_model_dir):
    """Batched, per-sequence policies/budgets/buffers: after every round the log-probs equal full attention
    with the logged evicted positions masked per (layer, KV head) (kvtier.reference.MaskedReplay)."""
    specs = [EvictionSpec(policy="random", budget=48, buffer=16, seed=1),
             EvictionSpec(policy="snapkv", budget=40, buffer=16),
             EvictionSpec(policy="h2o", budget=56, buffer=8, protect_prompt=True)]
    outs = ref.generate([Request(p, s, max_new_tokens=130) for p, s in zip(PROMPTS, specs)])
    replay = MaskedReplay(tiny_model_dir)
    for p, s, o in zip(PROMPTS, specs, outs):
        assert o.rounds >= 4
        assert [r["query_position"] for r in o.records] == round_schedule(len(p), len(p) + 130, s)
        ids = p + o.token_ids
        got = torch.tensor(o.logprobs)
        err = (got - replay.logprobs(ids, len(p), o.records, s.buffer)).abs().max()
        assert err < 1e-3, f"{s.policy}: max |reference engine - masked replay| = {err:.2e}"
        control = (got - replay.logprobs(ids, len(p), [], s.buffer)).abs().max()
        assert control > 0.3, "eviction changed nothing; the comparison proves nothing"
        kept = torch.tensor(o.records[-1]["kept"])                 # [L, H, K]
        assert kept.shape[-1] == s.budget
        if s.policy in ("random", "h2o"):                         # prompt protected
            assert (kept[..., : len(p)] == torch.arange(len(p))).all()
        assert not torch.equal(kept[:, 0], kept[:, 1])             # per KV head
