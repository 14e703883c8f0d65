"""The vectorised death-time derivation equals the engines' draw and the per-round, per-layer simulation it
replaced (kvtier.deathtime.keyed_host, simulate). The engine oracle tests are in tests/test_deathtime.py."""

import pytest
import torch

from kvtier.deathtime import NEVER, simulate_deaths
from kvtier.deathtime.keyed_host import keyed_victims_host
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.policies.compaction import hole_fill_plan
from kvtier.policies.keyed_random import keyed_victims, seed_key
from kvtier.policies.random import RandomPolicy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("rounds, layers, heads, low, n_cand, k", [
    (5, 3, 2, 0, 200, 8),
    (3, 2, 4, 30, 400, 64),          # a protected prefix
    (4, 2, 2, 3, 40, 30),            # 4k > n: rows short of distinct draws take the engines' fallback
    (2, 1, 3, 0, 70, 60),            # nearly every row short
    (2, 36, 8, 1024, 4224, 128),     # Qwen3-4B rows at a 3072 budget
])
def test_host_draw_equals_the_engines_keyed_victims(rounds, layers, heads, low, n_cand, k):
    for seed, head0 in ((1, 0), (2 ** 40 + 7, 4)):                   # a 64-bit seed; a tensor-parallel rank's heads
        hs = torch.arange(head0, head0 + heads)
        r = torch.arange(1, rounds + 1)
        want = keyed_victims(torch.full((rounds,), seed_key(seed)), r, layers, hs, torch.full((rounds,), low),
                             n_cand, k)
        got = keyed_victims_host(seed_key(seed), r, layers, hs, low, n_cand, k)
        assert got.dtype == torch.long and torch.equal(got, want)


def _per_layer_reference(policy, schedule, prompt_len, length, *, num_layers, num_kv_heads, seed, heads=None):
    """The simulation before vectorising: one keyed draw and one hole-filling plan per layer, per round."""
    from kvtier.deathtime import round_positions

    L, H = num_layers, num_kv_heads
    heads = torch.arange(H) if heads is None else heads
    deaths = torch.full((L, H, length), NEVER, dtype=torch.int32)
    slots = torch.full((L, H, max(schedule.max_cached, prompt_len) + 1), -1, dtype=torch.long)
    slots[:, :, :prompt_len] = torch.arange(prompt_len)
    physical = appended = prompt_len
    for i, qp in enumerate(round_positions(schedule, prompt_len, length), start=1):
        slots[:, :, physical : physical + qp + 1 - appended] = torch.arange(appended, qp + 1)
        physical, appended = physical + qp + 1 - appended, qp + 1
        assert type(policy) is RandomPolicy
        victims = keyed_victims(torch.tensor([seed_key(seed)]), torch.tensor([i]), L, heads,
                                torch.tensor([policy.protected_len(prompt_len)]), schedule.num_candidates(physical),
                                schedule.num_evicted(physical))[0]
        dead = slots.gather(2, victims)
        deaths.scatter_(2, dead, torch.full(dead.shape, qp + 1, dtype=torch.int32))
        for l in range(L):
            plan = hole_fill_plan(victims[l], physical)
            slots[l].scatter_(1, plan.dst, slots[l].gather(1, plan.src))
        physical -= victims.shape[-1]
        slots[:, :, physical:] = -1
    return deaths


@pytest.mark.parametrize("budget, buffer, prompt, length, params, heads", [
    (24, 8, 20, 150, {}, None),
    (48, 16, 30, 400, {"protect_prefix": 4}, None),
    (16, 4, 40, 200, {"protect_prefix": 0}, None),
    (64, 64, 5, 700, {}, None),
    (8, 2, 3, 120, {}, torch.tensor([6, 7])),                        # the heads of tensor-parallel rank 3
    (512, 32, 100, 3000, {}, None),
])
def test_vectorised_simulation_equals_the_per_layer_one(budget, buffer, prompt, length, params, heads):
    policy, sched = make_policy("random", **params), EvictionSchedule(budget, buffer)
    kw = dict(num_layers=3, num_kv_heads=2, seed=budget + length, heads=heads)
    got = simulate_deaths(policy, sched, prompt, length, **kw)
    want = _per_layer_reference(policy, sched, prompt, length, **kw)
    assert (want != NEVER).any() and torch.equal(got, want)


def test_the_store_derives_each_sample_once_per_step_within_its_bytes():
    """Three passes over four samples (reference, old log-probs, update) with room for two: each stored sample
    is derived once, the others once per pass; every answer equals a fresh derivation; the next step's first
    sample starts the store over; the compact form is a quarter of the dense tensor (uint8 round index)."""
    from kvtier.deathtime import round_positions
    from kvtier.deathtime.store import DeathStore, decode, encode

    sched, policy = EvictionSchedule(24, 8), make_policy("random")

    def derive(seed):
        d = simulate_deaths(policy, sched, 20, 150, num_layers=4, num_kv_heads=2, seed=seed)
        return d, [qp + 1 for qp in round_positions(sched, 20, 150)]

    dense, times = derive(0)
    index, table = encode(dense, times)
    assert index.dtype.itemsize == 1 and torch.equal(decode(index, table), dense)
    one = index.nbytes + table.nbytes
    store = DeathStore(max_bytes=2 * one)
    for _ in range(3):
        for seed in range(4):
            assert torch.equal(decode(*store.get(seed, lambda s=seed: derive(s))), derive(seed)[0])
    assert store.derived == 2 + 2 * 3 and store.hits == 2 * 2 and store.bytes == 2 * one
    store.get(99, lambda: derive(99))                         # the next step
    assert store.bytes == one and store.derived == 9
    assert torch.equal(decode(*store.get(99, lambda: derive(99))), derive(99)[0]) and store.derived == 9


def test_micro_batches_of_a_step_share_one_derivation():
    """The learner's forwards through one store: the second and third passes derive nothing, same tensors."""
    from tensordict import TensorDict

    from kvtier.deathtime.store import DeathStore
    from kvtier.rollout.learner_replay import micro_batch_deaths

    fields = {"kvtier_budget": 24, "kvtier_buffer": 8, "kvtier_policy": "random", "kvtier_policy_params": None,
              "kvtier_preemptions": 0, "kvtier_generate_calls": 1}
    mb = TensorDict({"input_ids": torch.nested.nested_tensor([torch.zeros(150, dtype=torch.long)] * 2,
                                                             layout=torch.jagged)}, batch_size=[2])
    mb["prompts"] = torch.nested.nested_tensor([torch.zeros(20, dtype=torch.long)] * 2, layout=torch.jagged)
    mb["extra_fields"] = [{**fields, "kvtier_seed": s} for s in (1, 2)]
    store = DeathStore(64 << 20)
    first, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2, store=store)
    fresh, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2, store=DeathStore(0))
    for _ in range(2):
        again, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2, store=store)
        assert torch.equal(again, first)
    assert torch.equal(first, fresh) and store.derived == 2 and store.hits == 4


def test_the_kv_head_block_mask_is_the_query_head_one():
    """FlexAttention's block mask built over the KV heads and repeated for each group equals the one built
    over every query head (same block tables), and its mask_mod, called with a query head, gives the dense
    death-time visibility of that head's KV head."""
    from torch.nn.attention.flex_attention import create_block_mask

    from kvtier.deathtime.attention import kv_head_block_mask
    from kvtier.deathtime.record import visibility

    g = torch.Generator().manual_seed(1)
    B, H, G, T = 2, 2, 3, 300                                   # three 128-blocks, the last partial
    deaths = torch.randint(1, T + 1, (B, H, T), generator=g, dtype=torch.int32)
    deaths = torch.maximum(deaths, torch.arange(T, dtype=torch.int32) + 1)    # a real entry sees itself
    deaths[0, 1, :200] = NEVER                                  # whole blocks visible: full blocks differ by head

    def kv_mask(b, h, q, kv):
        return ((kv <= q) & (q < deaths[b, h, kv])) | (q == kv)

    got = kv_head_block_mask(kv_mask, B, H, G, T, device="cpu")
    want = create_block_mask(lambda b, h, q, kv: kv_mask(b, h // G, q, kv), B, H * G, T, T, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    b, h, q, kv = (t.reshape(-1) for t in torch.meshgrid(torch.arange(B), torch.arange(H * G), torch.arange(T),
                                                         torch.arange(T), indexing="ij"))
    dense = got.mask_mod(b, h, q, kv).view(B, H * G, T, T)
    assert torch.equal(dense, visibility(deaths).repeat_interleave(G, dim=1) | torch.eye(T, dtype=torch.bool))
