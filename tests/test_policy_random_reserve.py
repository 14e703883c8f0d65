"""`random_reserve`: protected prompt, a top-scored reserve of ⌊ρ·(K − p)⌋, a uniform draw for the rest.
Pure torch (the engine's dispatch of it: tests/test_engine_policies.py)."""

import dataclasses
import math

import pytest
import torch

from kvtier.policies import EvictionContext, PolicyError, complement, make_policy

H, S, P, K, D = 2, 24, 4, 12, 8
NEEDLES = [[6, 11, 15, 20], [5, 9, 17, 22]]     # per head, most distinctive first (angle to the rest 90..75 deg)
NEAR = [13, 12]                             # per head, a fifth, less distinctive one (60 deg)


def _unit(i: int) -> torch.Tensor:
    return torch.eye(D)[i]


def needle_ctx(seed: int = 0, buffer: bool = True) -> EvictionContext:
    """Candidates whose keys point along e0 (small noise), except per head four needles at 90, 85, 80, 75
    degrees from e0 (each along its own axis), one at 60, and the prompt (positions 0..P-1) along e7."""
    g = torch.Generator().manual_seed(100)
    keys = _unit(0) + 0.02 * torch.randn(H, S, D, generator=g)
    for h in range(H):
        for axis, (j, deg) in enumerate(zip(NEEDLES[h] + [NEAR[h]], (90, 85, 80, 75, 60)), start=1):
            t = math.radians(deg)
            keys[h, j] = math.cos(t) * _unit(0) + math.sin(t) * _unit(axis)
        keys[h, :P] = _unit(7)                  # the most distinctive of all, but protected
    positions = torch.arange(S).expand(H, S).clone()
    return EvictionContext(positions=positions, budget=K, prompt_len=P, keys=keys,
                           buffer_keys=(_unit(0) + 0.02 * torch.randn(H, 3, D, generator=g)) if buffer else None,
                           generator=torch.Generator().manual_seed(seed))


def reference_keep(policy, ctx: EvictionContext, seed: int) -> list[list[int]]:
    """The rule written per head in plain Python: protected, then the top R by score, then the K - p - R
    candidates with the largest of one uniform draw [H, S] (the policy's generator) among the rest, i.e.
    all but the S - K smallest."""
    u = torch.rand((H, S), generator=torch.Generator().manual_seed(seed))
    score = policy.score(ctx)
    out = []
    for h in range(H):
        prot = [j for j in range(S) if int(ctx.positions[h, j]) < P]
        rest = sorted((j for j in range(S) if j not in prot), key=lambda j: -float(score[h, j]))
        R = math.floor(policy.reserve * (K - P))
        reserve, rest = rest[:R], rest[R:]
        dead = sorted(rest, key=lambda j: float(u[h, j]))[: S - K]
        out.append(sorted(set(prot) | set(reserve) | (set(rest) - set(dead))))
    return out


def test_registered_with_its_parameter():
    pol = make_policy("random_reserve", reserve=0.25)
    assert pol.params() == {"protect_prompt": True, "sinks": 0, "reserve": 0.25}
    assert pol.needs == {"keys"} and pol.optional == {"buffer_keys"} and pol.order_free


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_keep_sets(seed):
    pol = make_policy("random_reserve", reserve=0.5)       # R = ⌊0.5 · (12 − 4)⌋ = 4 seats, 4 drawn
    ctx = needle_ctx(seed)
    keep = pol.keep(ctx)
    assert keep.tolist() == reference_keep(pol, ctx, seed)
    for h in range(H):
        kept = set(keep[h].tolist())
        assert set(range(P)) <= kept                       # prompt protected (and not counted in the reserve)
        assert set(NEEDLES[h]) <= kept                     # the reserve: this head's four most distinctive
    assert keep.shape == (H, K) and (keep.diff(dim=1) > 0).all()
    ev = pol.evict(needle_ctx(seed))                       # same draw: the complement, ascending
    assert torch.equal(ev, complement(keep, S)) and (ev.diff(dim=1) > 0).all()


def test_the_reserve_is_the_top_scored_and_heads_differ():
    pol = make_policy("random_reserve", reserve=0.5)
    ctx = needle_ctx()
    score = pol.score(ctx)
    rkv0 = make_policy("rkv", mix_lambda=0.0)            # the score is rkv's redundancy term (λ = 0)
    ctx_q = dataclasses.replace(ctx, queries=torch.randn(2 * H, 8, D))
    assert torch.allclose(score, rkv0.score(ctx_q))
    for h in range(H):
        top = score[h, P:].argsort(descending=True)[:5] + P
        assert top[:4].sort().values.tolist() == NEEDLES[h] and int(top[4]) == NEAR[h]
    reserves = [{j for j in range(S) if all(j in k for k in
                                               [pol.keep(needle_ctx(s))[h].tolist() for s in range(20)])} - set(range(P))
                for h in range(H)]
    assert reserves == [set(NEEDLES[0]), set(NEEDLES[1])]  # only the reserve is in every draw's keep-set
    keeps = pol.keep(needle_ctx(3))
    assert set(keeps[0].tolist()) != set(keeps[1].tolist())


def test_order_free_and_without_buffer_keys():
    """Candidates in any slot order keep the same positions in the reserve; without buffer keys the score
    runs over the candidates alone (as rkv's)."""
    pol = make_policy("random_reserve", reserve=0.5)
    ctx = needle_ctx()
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(5))
    shuffled = dataclasses.replace(ctx, positions=ctx.positions[:, perm], keys=ctx.keys[:, perm])
    kept = shuffled.positions.gather(1, pol.keep(shuffled))
    for h in range(H):
        assert set(NEEDLES[h]) | set(range(P)) <= set(kept[h].tolist())
    keep = make_policy("random_reserve", reserve=0.5).keep(needle_ctx(buffer=False))
    assert all(set(NEEDLES[h]) <= set(keep[h].tolist()) for h in range(H))


def test_reserve_zero_is_random_in_distribution():
    """ρ = 0: every unprotected candidate kept with probability (K − p)/(S − p), as random."""
    rows, S_, P_, K_ = 400, 30, 5, 15
    g = torch.Generator().manual_seed(0)
    pol = make_policy("random_reserve", reserve=0.0)
    counts = torch.zeros(S_)
    draws = 0
    for seed in range(10):
        ctx = EvictionContext(positions=torch.arange(S_).expand(rows, S_), budget=K_, prompt_len=P_,
                              keys=torch.randn(rows, S_, D, generator=g), generator=torch.Generator().manual_seed(seed))
        keep = pol.keep(ctx)
        counts += torch.zeros(rows, S_).scatter_(1, keep, 1.0).sum(dim=0)
        draws += rows
    freq = counts / draws
    assert (freq[:P_] == 1).all()
    want = (K_ - P_) / (S_ - P_)                            # 0.4; sd over 4000 draws ~0.008
    assert (freq[P_:] - want).abs().max() < 0.04, freq


def test_reserve_near_one_is_top_score():
    """ρ → 1: all but ⌈(1 − ρ)(K − p)⌉ unprotected seats are the top-scored (rkv at λ = 0, prompt protected)."""
    pol = make_policy("random_reserve", reserve=0.9)          # R = ⌊0.9 · 8⌋ = 7 of 8 seats
    ctx = needle_ctx()
    score = pol.score(ctx)
    keep = pol.keep(ctx)
    for h in range(H):
        top7 = (score[h, P:].argsort(descending=True)[:7] + P).tolist()
        assert set(top7) | set(range(P)) <= set(keep[h].tolist())
    top = make_policy("rkv", mix_lambda=0.0, protect_prompt=True, sinks=0).keep(
        dataclasses.replace(needle_ctx(), queries=torch.randn(2 * H, 8, D)))
    overlap = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(keep, top)]
    assert min(overlap) >= K - 1


def test_key_redundancy_is_rkvs_mean_key_cosine():
    """The score's matmul form equals rkv's c̄ on fp32 keys (a strided slice, zero keys included) and
    stays within 5e-3 on bf16 ones (the engines' cache dtype)."""
    from kvtier.policies.random_reserve import key_redundancy
    from kvtier.policies.rkv import mean_key_cosine

    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 50, 16, generator=g) + torch.randn(6, 1, 16, generator=g)
    cache[1, 7] = 0.0
    keys, buf = cache[:, :42], cache[:, 42:]                 # candidates and buffer: slices of one cache
    assert not keys.is_contiguous()
    for others in (None, buf):
        assert torch.allclose(key_redundancy(keys, others), mean_key_cosine(keys, others), atol=1e-6)
    bf = cache.to(torch.bfloat16)
    err = (key_redundancy(bf[:, :42], bf[:, 42:]) - mean_key_cosine(bf[:, :42], bf[:, 42:])).abs().max()
    assert err < 5e-3, err


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "a lot", None])
def test_bad_reserve_refused_by_name(bad):
    with pytest.raises(PolicyError, match="reserve"):
        make_policy("random_reserve", reserve=bad)
    with pytest.raises(PolicyError, match="reserve"):
        dataclasses.replace(make_policy("random_reserve"), reserve=bad)
    with pytest.raises(PolicyError, match="keys"):
        make_policy("random_reserve").keep(EvictionContext(positions=torch.arange(S).expand(H, S), budget=K, prompt_len=P))


def test_seeded_runs_are_exact_and_seeds_differ():
    pol = make_policy("random_reserve")
    a, b = pol.keep(needle_ctx(7)), pol.keep(needle_ctx(7))
    assert torch.equal(a, b)
    assert any(not torch.equal(a, pol.keep(needle_ctx(s))) for s in range(8, 12))
    assert pol.keep(dataclasses.replace(needle_ctx(), budget=S)).tolist() == [list(range(S))] * H
    assert pol.evict(dataclasses.replace(needle_ctx(), budget=S + 3)).shape == (H, 0)
    with pytest.raises(PolicyError, match="prompt_len"):
        pol.keep(dataclasses.replace(needle_ctx(), prompt_len=K + 1))


def test_service_tier_carries_the_reserve():
    from kvtier.engine.config import EvictionConfigError, resolve_request_spec, validate_request
    from kvtier.service.config import parse_config

    cfg = parse_config({
        "engines": {"cpu": {"model": "tiny", "max_model_len": 4096}},
        "tiers": [{"name": "full", "engine": "cpu", "budget": "full"},
                  {"name": "insured", "engine": "cpu", "budget": 512, "policy": "random_reserve",
                   "params": {"reserve": 0.1}}],
        "server": {"auth": "open"},
    })
    tier = cfg.tier("insured")
    spec = tier.spec
    assert spec.policy == "random_reserve" and spec.params == {"reserve": 0.1}
    pol = spec.make_policy()
    assert pol.name == "random_reserve" and pol.reserve == 0.1 and pol.protect_prompt
    xargs = tier.extra_args()
    assert xargs["kvtier_policy"] == "random_reserve" and xargs["kvtier_params"] == '{"reserve": 0.1}'
    served = resolve_request_spec(spec, xargs)            # what the engine resolves from the request
    assert served.make_policy().params() == pol.params()
    validate_request(served, 100)
    bad = resolve_request_spec(spec, {**xargs, "kvtier_params": '{"reserve": 1.0}'})
    with pytest.raises(EvictionConfigError, match="reserve"):
        validate_request(bad, 100)


def test_replay_record_arithmetic_and_no_simulation():
    """The docstring's numbers: a sample must carry its record (simulate_deaths cannot re-derive it)."""
    from kvtier.deathtime import record_bytes, round_positions, simulate_deaths
    from kvtier.policies import EvictionSchedule

    rounds = round_positions(EvictionSchedule(3072, 128), 512, 32768)
    assert len(rounds) == 230 < 255                          # a uint8 round index per entry (255 = never)
    assert record_bytes(torch.empty(36, 8, 32768, dtype=torch.int32)) == 37_748_736
    assert record_bytes(torch.empty(36, 8, 32768, dtype=torch.uint8)) == 9_437_184
    assert 230 * 36 * 8 * 3072 * 2 == 406_978_560            # the audit log's keep-sets as uint16
    with pytest.raises(ValueError, match="reads"):
        simulate_deaths(make_policy("random_reserve"), EvictionSchedule(16, 4), 4, 40, num_layers=1,
                        num_kv_heads=1, seed=0)
