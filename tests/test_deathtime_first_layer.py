"""Simulating a policy that reads only first-layer keys (`random_line_reserve`) from those keys: the keys are
the model's own (what the engines cache for layer 0), the simulated records equal the reference engine's
keep-sets for the same eviction seed, and what cannot be simulated this way is refused.

CPU, the tiny Qwen3 (reference engine, float32)."""

import pytest
import torch

from kvtier.deathtime import deaths_from_rounds, first_layer_keys, reads_first_layer_keys, simulate_deaths
from kvtier.engine.config import EvictionSpec
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.reference import Request

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NAME = "random_line_reserve"


def test_first_layer_keys_are_the_models_cached_keys(tiny_model_dir):
    """Layer 0's post-RoPE keys as the model's own forward caches them (transformers' DynamicCache), per
    row of a right-padded batch."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, 2000, (2, 40), generator=torch.Generator().manual_seed(0))
    got = first_layer_keys(model, ids)
    assert got.shape == (2, 2, 40, 64) and got.dtype == torch.float32
    for b, n in ((0, 40), (1, 23)):                           # row 1 as if right-padded after 23 tokens
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.model(input_ids=ids[b : b + 1, :n], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(got[b, :, :n], cache.layers[0].keys[0].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [
    EvictionSpec(policy=NAME, budget=48, buffer=16, seed=1, params={"reserve": 0.5, "span": 2}),   # m = 3
    EvictionSpec(policy=NAME, budget=64, buffer=16, seed=6),                                        # defaults: m = 1
])
def test_simulated_keep_sets_equal_the_reference_engines(ref, spec):
    """The reference engine decodes under the policy; simulate_deaths from the trace's first-layer keys and
    the same seed gives exactly its rounds' deaths. Power: the reserve was used, and other keys (noise)
    give other records."""
    prompt = list(range(10, 26))
    out = ref.generate([Request(prompt, spec, max_new_tokens=130)])[0]
    ids = prompt + out.token_ids
    n = len(ids)
    keys = first_layer_keys(ref.model, torch.tensor([ids]))[0]
    want = deaths_from_rounds(out.records, 4, 2, n, spec.buffer)
    sim = dict(num_layers=4, num_kv_heads=2, seed=spec.seed)
    got = simulate_deaths(spec.make_policy(), spec.schedule(), len(prompt), n, first_keys=keys, **sim)
    assert out.rounds >= 4
    assert torch.equal(got, want)
    alive_everywhere = (want == torch.iinfo(torch.int32).max).flatten(0, 1).all(dim=0)
    assert alive_everywhere[len(prompt) : n - 2 * spec.buffer].any()       # a reserved line, in every row
    noise = torch.randn(keys.shape, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(simulate_deaths(spec.make_policy(), spec.schedule(), len(prompt), n, first_keys=noise,
                                           **sim), want)


def test_what_first_keys_cannot_replay_is_refused():
    sched, keys = EvictionSchedule(16, 4), torch.zeros(2, 60, 8)
    sim = dict(num_layers=2, num_kv_heads=2, seed=0)
    assert reads_first_layer_keys(make_policy(NAME)) and not reads_first_layer_keys(make_policy("random_reserve"))
    with pytest.raises(ValueError, match="first_keys"):                     # it reads keys: give them
        simulate_deaths(make_policy(NAME), sched, 4, 60, **sim)
    for other in ("snapkv", "random"):                                      # reads more, or nothing
        with pytest.raises(ValueError, match="cannot replay"):
            simulate_deaths(make_policy(other), sched, 4, 60, first_keys=keys, **sim)
    with pytest.raises(ValueError, match="rebuilt cache"):
        simulate_deaths(make_policy(NAME), sched, 4, 60, first_keys=keys, start=20, **sim)
    with pytest.raises(ValueError, match="kv_heads=2"):
        simulate_deaths(make_policy(NAME), sched, 4, 60, first_keys=keys[:, :50], **sim)
