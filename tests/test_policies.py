"""Foundation policies: shapes, order, budget, protection, randomness, SnapKV's formula, bad input."""

import math

import pytest
import torch

from kvtier.policies import EvictionContext, PolicyError, available, complement, make_policy

FOUNDATION = ["random", "random_shared", "random_block", "recency", "streaming", "snapkv"]


def make_ctx(H=2, S=40, d=8, K=16, prompt_len=6, Hq=4, w=8, seed=0, scramble=False):
    g = torch.Generator().manual_seed(seed)
    # Heads hold different positions (as after per-head eviction), prompt always held, ascending.
    rows = []
    for _ in range(H):
        gen = prompt_len + torch.randperm(3 * S, generator=g)[: S - prompt_len]
        rows.append(torch.cat([torch.arange(prompt_len), gen.sort().values]))
    pos = torch.stack(rows)
    return EvictionContext(
        positions=pos, budget=K, prompt_len=prompt_len,
        keys=torch.randn(H, S, d, generator=g), values=torch.randn(H, S, d, generator=g),
        queries=torch.randn(Hq, w, d, generator=g), query_position=4 * S,
        generator=torch.Generator().manual_seed(seed + 1),
    )


def test_foundation_policies_registered():
    assert set(FOUNDATION) <= set(available())


@pytest.mark.parametrize("name", FOUNDATION)
@pytest.mark.parametrize("protect", [True, False])
def test_keep_shape_order_budget_protection(name, protect):
    ctx = make_ctx()
    pol = make_policy(name, protect_prompt=protect)
    keep = pol.keep(ctx)
    assert keep.shape == (2, 16)
    assert keep.dtype == torch.long
    assert (keep.diff(dim=1) > 0).all(), "keep-set must be strictly ascending (chronological)"
    assert ((keep >= 0) & (keep < 40)).all()
    kept_pos = ctx.positions.gather(1, keep)
    protected = pol.protected_len(ctx.prompt_len)
    for h in range(2):
        assert set(range(protected)) <= set(kept_pos[h].tolist()), "protected positions must survive"
    evict = pol.evict(make_ctx())
    assert evict.shape == (2, 24)
    assert torch.equal(torch.sort(torch.cat([keep, evict], 1), 1).values, torch.arange(40).expand(2, 40))


def test_protection_defaults_follow_the_paper():
    assert make_policy("random").protect_prompt and make_policy("random_shared").protect_prompt
    assert make_policy("random_block").protect_prompt and make_policy("recency").protect_prompt
    assert not make_policy("snapkv").protect_prompt and make_policy("snapkv").sinks == 4
    assert not make_policy("streaming").protect_prompt and make_policy("streaming").sinks == 4


@pytest.mark.parametrize("name", FOUNDATION)
def test_keeps_everything_when_under_budget(name):
    ctx = make_ctx(S=12, K=16)
    assert torch.equal(make_policy(name).keep(ctx), torch.arange(12).expand(2, 12))
    assert make_policy(name).evict(ctx).shape == (2, 0)


def test_random_heads_independent_and_seeded():
    ctx = make_ctx(H=8, S=200, K=64)
    ctx.positions = torch.arange(200).expand(8, 200).clone()  # identical holdings in every head
    pol = make_policy("random")
    a = pol.keep(ctx)
    ctx.generator = torch.Generator().manual_seed(1)
    b = pol.keep(ctx)
    assert torch.equal(a, b), "same seed must give the same keep-sets"
    assert len({tuple(r) for r in a.tolist()}) == 8, "heads must draw independently"
    ctx.generator = torch.Generator().manual_seed(2)
    assert not torch.equal(a, pol.keep(ctx))


def test_random_shared_identical_across_heads_by_position():
    ctx = make_ctx(H=4, S=100, K=30)
    base = torch.arange(100)
    # Same positions, different slot order per head: the shared draw is keyed by position.
    ctx.positions = torch.stack([base, base, base, base])
    keep = make_policy("random_shared").keep(ctx)
    kept = ctx.positions.gather(1, keep)
    assert all(torch.equal(kept[0], kept[h]) for h in range(4))


def test_random_block_keeps_whole_blocks():
    ctx = make_ctx(H=3, S=128, K=64, prompt_len=0)
    ctx.positions = torch.arange(128).expand(3, 128).clone()
    keep = make_policy("random_block", block=16).keep(ctx)
    for h in range(3):
        blocks = torch.bincount(keep[h] // 16, minlength=8)
        assert sorted(blocks.tolist()) == [0, 0, 0, 0, 16, 16, 16, 16]
    assert not torch.equal(keep[0], keep[1]) or not torch.equal(keep[1], keep[2])


def test_recency_keeps_prompt_plus_most_recent():
    ctx = make_ctx(H=1, S=30, K=10, prompt_len=4)
    ctx.positions = torch.arange(30).unsqueeze(0)
    kept = make_policy("recency").keep(ctx)[0].tolist()
    assert kept == [0, 1, 2, 3] + list(range(24, 30))
    kept = make_policy("streaming").keep(ctx)[0].tolist()  # 4 sinks, no prompt protection
    assert kept == [0, 1, 2, 3] + list(range(24, 30))
    ctx.prompt_len = 8
    assert make_policy("recency").keep(ctx)[0].tolist() == list(range(8)) + [28, 29]


def test_random_survival_matches_closed_form():
    """Appendix D: after n rounds a protected-prompt cache keeps an unprotected candidate with
    probability ((K - lp) / (K + r - lp))^n. Checked on 20k heads with a 5-sigma binomial bound."""
    from kvtier.policies import DenseHeadCache, EvictionSchedule

    H, K, r, lp, d = 20000, 24, 8, 4, 1
    sched = EvictionSchedule(budget=K, buffer=r)
    cache = DenseHeadCache(H, d, K + 2 * r, device="cpu")
    cache.append(torch.zeros(H, K + 2 * r, d), torch.zeros(H, K + 2 * r, d), 0)
    pol, gen = make_policy("random"), torch.Generator().manual_seed(0)
    watched = K + r - 1  # the last candidate of the first round, a generated position
    p1 = sched.survival(lp)
    assert math.isclose(p1, (K - lp) / (K + r - lp))
    next_pos = K + 2 * r
    for n in range(1, 6):
        cache.evict_round(pol, sched, lp, generator=gen)
        frac = (cache.positions[:, : cache.length] == watched).any(1).float().mean().item()
        expect = p1**n
        sigma = math.sqrt(expect * (1 - expect) / H)
        assert abs(frac - expect) < 5 * sigma + 1e-9, (n, frac, expect)
        assert (cache.positions[:, :lp] == torch.arange(lp)).all(), "prompt held in place"
        cache.append(torch.zeros(H, r, d), torch.zeros(H, r, d), next_pos)
        next_pos += r


def test_snapkv_reproduces_its_formula():
    """Hand computed: H=1, d=1, one window query, keys chosen so softmax weights are known."""
    ctx = EvictionContext(
        positions=torch.arange(6).unsqueeze(0), budget=2, prompt_len=0,
        keys=torch.log(torch.tensor([1.0, 2.0, 4.0, 1.0, 8.0, 1.0])).view(1, 6, 1),
        queries=torch.ones(1, 1, 1),
    )
    # q.k/sqrt(1) = log(w) so softmax = w / sum(w) = [1,2,4,1,8,1]/17
    pol = make_policy("snapkv", window=1, kernel=1, sinks=0)
    assert torch.allclose(pol.score(ctx), torch.tensor([[1, 2, 4, 1, 8, 1]]) / 17.0)
    assert pol.keep(ctx).tolist() == [[2, 4]]
    # max-pool of width 3: [2,4,4,8,8,8]/17; topk 2 -> tie among 3,4,5; sinks=1 forces position 0.
    pooled = make_policy("snapkv", window=1, kernel=3, sinks=0).score(ctx)
    assert torch.allclose(pooled, torch.tensor([[2, 4, 4, 8, 8, 8]]) / 17.0)
    assert make_policy("snapkv", window=1, kernel=1, sinks=1).keep(ctx).tolist() == [[0, 4]]
    # Buffer keys join the softmax normalisation; GQA groups are averaged; window sums over queries.
    ctx.buffer_keys = torch.log(torch.tensor([3.0])).view(1, 1, 1)
    assert torch.allclose(pol.score(ctx), torch.tensor([[1, 2, 4, 1, 8, 1]]) / 20.0)
    ctx.buffer_keys = None
    ctx.queries = torch.stack([torch.ones(2, 1), torch.zeros(2, 1)])  # 2 query heads x 2 window queries
    expect = (2 * torch.tensor([1, 2, 4, 1, 8, 1]) / 17.0 + 2 * torch.full((6,), 1 / 6)) / 2
    assert torch.allclose(make_policy("snapkv", window=2, kernel=1).score(ctx)[0], expect)


def test_snapkv_window_queries_are_causal():
    """Two window queries (the two newest tokens) and two buffer keys (the newest is the last query's own
    token): the older query does not see the newest buffer key, as in the model and kvpress. With q = 1
    and d = 1 the softmax weights are the exp(key)s: candidates [1,2,4,1,8,1], buffer [3, 5]."""
    ctx = EvictionContext(
        positions=torch.arange(6).unsqueeze(0), budget=2, prompt_len=0,
        keys=torch.log(torch.tensor([1.0, 2.0, 4.0, 1.0, 8.0, 1.0])).view(1, 6, 1),
        queries=torch.ones(1, 2, 1), buffer_keys=torch.log(torch.tensor([3.0, 5.0])).view(1, 2, 1),
    )
    w = torch.tensor([[1, 2, 4, 1, 8, 1]])
    pol = make_policy("snapkv", window=2, kernel=1, sinks=0)
    assert torch.allclose(pol.score(ctx), w / 20.0 + w / 25.0)  # older query: 17 + 3; newest: 17 + 3 + 5
    ctx.query_position = 7  # candidates 0-5, buffer 6-7: positions add nothing when the window fits the buffer
    assert torch.allclose(pol.score(ctx), w / 20.0 + w / 25.0)
    # A window longer than the buffer: queries at 4..7 (buffer 6, 7). The query at 4 sees candidates 0-4,
    # the one at 5 candidates 0-5, then 6 adds buffer key 6 and 7 everything.
    ctx.queries = torch.ones(1, 4, 1)
    expect = (w.masked_fill(torch.arange(6) > 4, 0) / 16.0 + w / 17.0 + w / 20.0 + w / 25.0)
    assert torch.allclose(make_policy("snapkv", window=4, kernel=1, sinks=0).score(ctx), expect)


@pytest.mark.parametrize("bad, match", [
    (dict(budget=0), "budget"),
    (dict(budget=-3), "budget"),
    (dict(budget=4, prompt_len=6), "budget=4 cannot hold"),
])
def test_bad_budget(bad, match):
    ctx = make_ctx()
    for k, v in bad.items():
        setattr(ctx, k, v)
    with pytest.raises(PolicyError, match=match):
        make_policy("random").keep(ctx)


def test_bad_names_and_shapes():
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(PolicyError, match="bad parameters for policy 'random'"):
        make_policy("random", window=3)
    with pytest.raises(PolicyError, match="block"):
        make_policy("random_block", block=0)
    ctx = make_ctx()
    ctx.keys = ctx.keys[:, :5]
    with pytest.raises(PolicyError, match="keys must be"):
        make_policy("snapkv").keep(ctx)
    ctx = make_ctx()
    ctx.queries = None
    with pytest.raises(PolicyError, match="needs 'queries'"):
        make_policy("snapkv").keep(ctx)
    ctx = make_ctx(Hq=3)
    with pytest.raises(PolicyError, match="multiple of H"):
        make_policy("snapkv").keep(ctx)


def test_complement():
    idx = torch.tensor([[0, 3], [1, 2]])
    assert complement(idx, 5).tolist() == [[1, 2, 4], [0, 3, 4]]


def test_sample_distinct_is_uniform_over_subsets():
    """The sparse draw (first k distinct of ~1.5k draws) picks every element with probability k/n, and
    pairs with probability k(k-1)/(n(n-1)); checked on 40k rows with 5-sigma bounds."""
    from kvtier.policies.random import sample_distinct

    rows, n, k = 40000, 40, 6
    s = sample_distinct(rows, n, k, torch.Generator().manual_seed(3), "cpu")
    assert s.shape == (rows, k) and (s.diff(dim=1) > 0).all() and s.min() >= 0 and s.max() < n
    hits = torch.zeros(rows, n).scatter_(1, s, 1.0)
    p = k / n
    sigma = math.sqrt(p * (1 - p) / rows)
    assert (hits.mean(0) - p).abs().max() < 5 * sigma
    pair = (hits[:, 0] * hits[:, 1]).mean().item()
    p2 = k * (k - 1) / (n * (n - 1))
    assert abs(pair - p2) < 5 * math.sqrt(p2 * (1 - p2) / rows)
    # the dense fallback (k > n/4) returns valid subsets too
    d = sample_distinct(100, 10, 5, torch.Generator().manual_seed(0), "cpu")
    assert all(len(set(r)) == 5 for r in d.tolist())


# -- policies are dataclasses ---------------------------------------------------------------------
# params() of every registered policy at its defaults, keys in order (what the hand-written params()
# returned before policies became dataclasses).
DEFAULT_PARAMS = {
    "random": {"protect_prompt": True, "sinks": 0},
    "random_shared": {"protect_prompt": True, "sinks": 0},
    "random_block": {"protect_prompt": True, "sinks": 0, "block": 16},
    "random_reserve": {"protect_prompt": True, "sinks": 0, "reserve": 0.1},
    "random_line_reserve": {"protect_prompt": True, "sinks": 0, "reserve": 0.1, "span": 5},
    "recency": {"protect_prompt": True, "sinks": 0},
    "streaming": {"protect_prompt": False, "sinks": 4},
    "h2o": {"protect_prompt": False, "sinks": 4},
    "snapkv": {"protect_prompt": False, "sinks": 4, "window": 8, "kernel": 7},
    "rkv": {"protect_prompt": False, "sinks": 4, "window": 8, "kernel": 7, "mix_lambda": 0.5},
    "vase": {"protect_prompt": False, "sinks": 4, "window": 8, "kernel": 7, "large_fraction": 0.25, "n_large": None},
    "diverse": {"protect_prompt": False, "sinks": 4, "window": 8, "profile": "global", "a1": (0.0,),
                "a2": (math.asinh(-0.15),), "pool_factor": 4, "layer": None, "num_layers": None},
    "triattention": {"protect_prompt": True, "sinks": 0, "layer": None, "max_offset": 65536},
}


def test_every_policy_is_a_dataclass_whose_fields_are_its_params():
    import dataclasses

    assert set(DEFAULT_PARAMS) == set(available())
    for name, want in DEFAULT_PARAMS.items():
        pol = make_policy(name)
        assert dataclasses.is_dataclass(pol)
        assert list(pol.params().items()) == list(want.items()), name
        names = [f.name for f in dataclasses.fields(pol)]
        assert [n for n in names if n in want] == list(want), name  # params() follows field order
        assert set(names) - set(want) <= {"protect_prefix", "calibration"}, name
        assert repr(pol) == f"{type(pol).__name__}({', '.join(f'{k}={v!r}' for k, v in want.items())})"
        assert {pol: 1}[pol] == 1 and pol != make_policy(name)  # identity equality: hashable, as before
        with pytest.raises(TypeError):
            type(pol)(True)  # keyword-only, as the hand-written constructors were
    assert repr(make_policy("snapkv")) == "SnapKVPolicy(protect_prompt=False, sinks=4, window=8, kernel=7)"


def test_policy_fields_are_validated_and_normalised_on_construction_and_replace():
    import dataclasses

    pol = make_policy("snapkv", window=4.0, kernel=3, protect_prefix=16, sinks=2)
    assert pol.params() == {"protect_prompt": True, "sinks": 2, "protect_prefix": 16, "window": 4, "kernel": 3}
    assert type(pol.window) is int
    assert make_policy("diverse", a1=[0.5]).a1 == (0.5,)  # JSON lists become tuples
    assert make_policy("random_block", block=8).params()["block"] == 8
    other = dataclasses.replace(pol, kernel=5)
    assert other.params() == {**pol.params(), "kernel": 5} and pol.kernel == 3
    with pytest.raises(PolicyError, match="kernel"):
        dataclasses.replace(pol, kernel=4)
    with pytest.raises(PolicyError, match="protect_prefix"):
        make_policy("random", protect_prefix=4, protect_prompt=False)
    with pytest.raises(PolicyError, match="sinks"):
        make_policy("h2o", sinks=-1)
    with pytest.raises(PolicyError, match="bad parameters for policy 'snapkv'"):
        make_policy("snapkv", mix_lambda=0.5)


def test_a_plain_subclass_with_its_own_init_still_works():
    """Like src/kvtier/evaluation/probes/pinning.py's PinnedRandomPolicy: not a dataclass, own __init__ and params()."""
    from kvtier.policies import EvictionPolicy

    class Pinned(EvictionPolicy):
        name = "_pinned"
        default_protect_prompt = False

        def __init__(self, facts, **kw):
            super().__init__(**kw)
            self.facts = list(facts)

        def params(self):
            return {**super().params(), "facts": self.facts}

        def score(self, ctx):
            return ctx.positions.float()

    pol = Pinned([(1, 2)], sinks=3)
    assert pol.params() == {"protect_prompt": False, "sinks": 3, "facts": [(1, 2)]}
    assert repr(pol) == "Pinned(protect_prompt=False, sinks=3, facts=[(1, 2)])"
    assert pol.keep(make_ctx()).shape == (2, 16)


def test_random_protected_prefix_check_reads_only_the_first_slots():
    """The fast path (victims drawn from the slots after the protected ones) needs the protected positions
    in the first n slots; with distinct positions per row the first n slots deciding it is exact."""
    from kvtier.policies.random import _protected_is_prefix

    rows = torch.stack([torch.cat([torch.randperm(4), 4 + torch.randperm(12)]) for _ in range(3)])
    assert _protected_is_prefix(rows, 4)
    moved = rows.clone()
    moved[1, [2, 7]] = moved[1, [7, 2]]            # a protected position out of the first slots
    assert not _protected_is_prefix(moved, 4)
    assert _protected_is_prefix(rows, 0) and not _protected_is_prefix(rows, 17)
    # both paths draw a valid keep-set that holds the protected positions
    ctx = EvictionContext(positions=moved, budget=8, prompt_len=4, generator=torch.Generator().manual_seed(0))
    kept = moved.gather(1, make_policy("random").keep(ctx))
    assert all(set(range(4)) <= set(r.tolist()) for r in kept)
