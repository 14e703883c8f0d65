"""Scored baselines: H2O, R-KV, VaSE, TriAttention, diversity-aware MMR. Each formula on a hand-computed
example, VaSE's sampler checked statistically, and prompt protection over many eviction rounds."""

import math

import pytest
import torch

from kvtier.policies import DenseHeadCache, EvictionContext, EvictionSchedule, PolicyError, available, make_policy
from kvtier.policies.diverse import depth_lambda, mmr_admit
from kvtier.policies.rkv import mean_key_cosine
from kvtier.policies.snapkv import SnapKVPolicy
from kvtier.policies.triattention import (TriAttentionCalibration, calibrate_from_samples, load_calibration,
                                          save_calibration)

SCORED = ["h2o", "rkv", "vase", "triattention", "diverse", "random_reserve"]
R2 = math.sqrt(0.5)


def small_calibration(H=2, d=8, layers=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = d // 2
    return TriAttentionCalibration(
        cos_coef=torch.randn(layers, H, M, generator=g), sin_coef=torch.randn(layers, H, M, generator=g),
        norm_weight=torch.rand(layers, H, M, generator=g), omega=10000.0 ** (-torch.arange(M) * 2.0 / d),
    )


def build(name, **kw):
    if name == "triattention":
        kw.setdefault("calibration", small_calibration())
        kw.setdefault("layer", 1)
    return make_policy(name, **kw)


def make_ctx(H=2, S=40, d=8, K=16, prompt_len=6, Hq=4, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(H):
        gen = prompt_len + torch.randperm(3 * S, generator=g)[: S - prompt_len]
        rows.append(torch.cat([torch.arange(prompt_len), gen.sort().values]))
    return EvictionContext(
        positions=torch.stack(rows), budget=K, prompt_len=prompt_len,
        keys=torch.randn(H, S, d, generator=g), values=torch.randn(H, S, d, generator=g),
        queries=torch.randn(Hq, w, d, generator=g), attention=torch.rand(H, S, generator=g),
        query_position=4 * S, generator=torch.Generator().manual_seed(seed + 1),
        extras={"layer": 2, "num_layers": 4},
    )


# -- interface --------------------------------------------------------------------------------------
def test_registered_with_paper_defaults():
    assert set(SCORED) <= set(available())
    assert not build("h2o").protect_prompt and build("h2o").sinks == 4
    assert build("rkv").mix_lambda == 0.5 and not build("rkv").protect_prompt and build("rkv").sinks == 4
    assert build("vase").large_count(3072) == 768 and not build("vase").protect_prompt
    assert build("triattention").protect_prompt  # keeps the whole input (paper §5.1)
    assert build("diverse").lambdas(make_ctx()) == pytest.approx((0.0, -0.15))


@pytest.mark.parametrize("name", SCORED)
@pytest.mark.parametrize("protect", [True, False])
def test_keep_shape_order_protection(name, protect):
    ctx = make_ctx()
    pol = build(name, protect_prompt=protect)
    keep = pol.keep(ctx)
    assert keep.shape == (2, 16) and keep.dtype == torch.long
    assert (keep.diff(dim=1) > 0).all()
    kept = ctx.positions.gather(1, keep)
    for h in range(2):
        assert set(range(pol.protected_len(ctx.prompt_len))) <= set(kept[h].tolist())
    evict = pol.evict(make_ctx())
    assert torch.equal(torch.cat([keep, evict], 1).sort(1).values, torch.arange(40).expand(2, 40))


@pytest.mark.parametrize("name", SCORED)
def test_keeps_everything_when_under_budget(name):
    ctx = make_ctx(S=12, K=16)
    assert torch.equal(build(name).keep(ctx), torch.arange(12).expand(2, 12))


@pytest.mark.parametrize("name", SCORED)
def test_budget_too_small_names_the_parameter(name):
    ctx = make_ctx(K=4, prompt_len=6)
    with pytest.raises(PolicyError, match="prompt_len"):
        build(name, protect_prompt=True).keep(ctx)
    with pytest.raises(PolicyError, match="sinks"):
        build(name, protect_prompt=False, sinks=5).keep(ctx)


# -- H2O --------------------------------------------------------------------------------------------
def test_h2o_keeps_the_largest_accumulated_attention():
    """Position i enters at step i; every step adds its attention to the entries present. Position 4
    gets the largest single-step attention but has accumulated the least time, so it loses."""
    steps = {2: [0.5, 0.2, 0.3], 3: [0.1, 0.1, 0.2, 0.6], 4: [0.05, 0.05, 0.1, 0.15, 0.55]}
    acc = torch.zeros(1, 5)
    for t in sorted(steps):
        acc[0, : t + 1] += torch.tensor(steps[t])
    assert torch.allclose(acc, torch.tensor([[0.65, 0.35, 0.6, 0.75, 0.55]]))
    ctx = EvictionContext(positions=torch.arange(5).unsqueeze(0), budget=3, prompt_len=0, attention=acc)
    assert build("h2o", sinks=0).keep(ctx).tolist() == [[0, 2, 3]]
    last = ctx.attention.clone()
    ctx.attention = torch.tensor([steps[4]])
    assert build("h2o", sinks=0).keep(ctx).tolist() == [[2, 3, 4]]  # the last step alone ranks differently
    ctx.attention = last
    assert build("h2o", sinks=2).keep(ctx).tolist() == [[0, 1, 3]]  # sinks first, then the best of the rest


# -- R-KV -------------------------------------------------------------------------------------------
def rkv_ctx(seed=0):
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).unsqueeze(0)  # known cosines
    g = torch.Generator().manual_seed(seed)
    return EvictionContext(positions=torch.arange(4).unsqueeze(0), budget=1, prompt_len=0, keys=keys,
                           queries=torch.randn(1, 3, 2, generator=g))


def test_rkv_redundancy_term_by_hand():
    # cos(k0,k1)=1, cos(k0,k2)=0, cos(k0,k3)=cos(k1,k3)=cos(k2,k3)=1/sqrt2, cos(k1,k2)=0
    expect = torch.tensor([[(1 + 0 + R2) / 3, (1 + 0 + R2) / 3, (0 + 0 + R2) / 3, 3 * R2 / 3]])
    ctx = rkv_ctx()
    assert torch.allclose(mean_key_cosine(ctx.keys), expect, atol=1e-6)
    pol = build("rkv", mix_lambda=0.0, sinks=0)
    assert torch.allclose(pol.score(ctx), 1 - expect, atol=1e-6)
    assert pol.keep(ctx).tolist() == [[2]]  # the least redundant key
    ctx.budget = 3
    assert pol.keep(ctx).tolist() == [[0, 1, 2]]  # k3 is the most redundant


@pytest.mark.parametrize("lam", [0.5, 0.1, 1.0])
def test_rkv_mixes_unit_mean_snapkv_with_redundancy(lam):
    ctx = rkv_ctx(seed=3)
    snap = SnapKVPolicy(window=8, kernel=3, sinks=0).score(ctx)
    imp = snap / snap.mean()
    red = 1 - torch.tensor([[(1 + R2) / 3, (1 + R2) / 3, R2 / 3, R2]])
    pol = build("rkv", mix_lambda=lam, kernel=3, sinks=0)
    assert torch.allclose(pol.importance(ctx).mean(), torch.tensor(1.0))
    assert torch.allclose(pol.score(ctx), lam * imp + (1 - lam) * red, atol=1e-6)
    with pytest.raises(PolicyError, match="mix_lambda"):
        build("rkv", mix_lambda=1.5)


def test_rkv_redundancy_counts_the_buffer_keys():
    """c̄ runs over every other cached key, the recent buffer's included (paper: 1/(N-1) Σ_{j≠i} over the
    cached keys; R-KV's cal_similarity covers its observation window too). Buffer key (0, 1): cos 0 with
    k0, k1, 1 with k2, 1/sqrt2 with k3; N = 5."""
    ctx = rkv_ctx()
    ctx.buffer_keys = torch.tensor([[[0.0, 1.0]]])
    expect = torch.tensor([[(1 + R2) / 4, (1 + R2) / 4, (1 + R2) / 4, 4 * R2 / 4]])
    assert torch.allclose(mean_key_cosine(ctx.keys, ctx.buffer_keys), expect, atol=1e-6)
    pol = build("rkv", mix_lambda=0.0, sinks=0)
    assert torch.allclose(pol.score(ctx), 1 - expect, atol=1e-6)
    ctx.budget = 3
    assert pol.keep(ctx).tolist() == [[0, 1, 2]]


# -- VaSE -------------------------------------------------------------------------------------------
def vase_ctx(H, K, seed=0):
    """Per head identical: S=10, value range of candidate i = ranges[i], candidates 0,1 are sinks."""
    ranges = torch.tensor([9.0, 9.0, 1.0, 5.0, 2.0, 7.0, 3.0, 0.5, 4.0, 6.0])
    values = torch.zeros(10, 4)
    values[:, 1] = ranges
    g = torch.Generator().manual_seed(seed)
    keys = 1.5 * torch.randn(10, 4, generator=g)
    queries = torch.randn(1, 8, 4, generator=g)
    return EvictionContext(positions=torch.arange(10).expand(H, 10), budget=K, prompt_len=0,
                           keys=keys.expand(H, 10, 4), values=values.expand(H, 10, 4), queries=queries.expand(H, 8, 4),
                           generator=torch.Generator().manual_seed(seed + 7))


def test_vase_large_range_set_exactly():
    # K=4: 2 sinks + n_large=2 (the two widest unprotected: 5 and 9), nothing left to sample.
    pol = build("vase", sinks=2, n_large=2)
    assert pol.keep(vase_ctx(3, 4)).tolist() == [[0, 1, 5, 9]] * 3
    # K=8, n_large = 8/4 = 2: {5, 9} always kept, 4 more sampled, never a protected one dropped.
    pol = build("vase", sinks=2)
    for seed in range(20):
        keep = pol.keep(vase_ctx(4, 8, seed=seed))
        assert all({0, 1, 5, 9} <= set(row) for row in keep.tolist())
    # Protected count toward K: K=4, 2 sinks, n_large=3 is cut to the 2 slots left.
    assert build("vase", sinks=2, n_large=3).keep(vase_ctx(1, 4)).tolist() == [[0, 1, 5, 9]]
    with pytest.raises(PolicyError, match="n_large"):
        build("vase", n_large=4).keep(vase_ctx(1, 4))


def _weights(ctx, eligible):
    snap = SnapKVPolicy(sinks=0, kernel=1).score(ctx)[0, eligible]
    return snap / snap.sum()


def test_vase_fill_is_proportional_to_snapkv():
    """One free slot: the draw lands on candidate i with probability snap_i / Σ snap over the eligible ones.
    N = 20000 heads, each an independent draw. Bounds: Pearson chi-square < 22.46 (df=6, p=0.001), every
    |p̂ - p| < 4 sigma; and the same statistic against a uniform fill must be far above the bound."""
    N = 20000
    ctx = vase_ctx(N, 4)  # K=4: 2 sinks + n_large = 4//4 = 1 -> {5}; one slot for {2, 3, 4, 6, 7, 8, 9}
    pol = build("vase", sinks=2, kernel=1)
    keep = pol.keep(ctx)
    assert (keep[:, :2] == torch.tensor([0, 1])).all() and (keep == 5).any(1).all()
    eligible = [2, 3, 4, 6, 7, 8, 9]
    drawn = keep[~torch.isin(keep, torch.tensor([0, 1, 5]))]
    assert drawn.numel() == N
    counts = torch.stack([(drawn == i).sum() for i in eligible]).double()
    p = _weights(ctx, eligible).double()
    assert p.max() / p.min() > 3, "the example must be far from uniform to have power"
    chi2 = ((counts - N * p) ** 2 / (N * p)).sum().item()
    assert chi2 < 22.46, chi2  # df = 6, p = 0.001
    assert ((counts / N - p).abs() < 4 * (p * (1 - p) / N).sqrt()).all()
    uniform = torch.full_like(p, 1 / len(eligible))
    assert ((counts - N * uniform) ** 2 / (N * uniform)).sum().item() > 100


def test_vase_fill_samples_without_replacement():
    """Two free slots: inclusion probability of i under successive sampling is
    p_i + Σ_{j≠i} p_j p_i / (1 - p_j); checked within 4 sigma on N = 20000 heads."""
    N = 20000
    ctx = vase_ctx(N, 5, seed=1)
    keep = build("vase", sinks=2, kernel=1).keep(ctx)  # K=5: n_large = 5//4 = 1 -> {5}; 2 draws
    eligible = [2, 3, 4, 6, 7, 8, 9]
    p = _weights(ctx, eligible).double()
    incl = torch.stack([(keep == i).any(1).double().mean() for i in eligible])
    expect = p + p * (p / (1 - p)).sum() - p * p / (1 - p)
    assert torch.allclose(expect.sum(), torch.tensor(2.0, dtype=torch.float64))
    assert ((incl - expect).abs() < 4 * (expect * (1 - expect) / N).sqrt()).all(), (incl, expect)
    assert not ((incl - 2 * p).abs() < 4 * (expect * (1 - expect) / N).sqrt()).all()  # not with replacement


def test_vase_seeded():
    a = build("vase").keep(make_ctx())
    assert torch.equal(a, build("vase").keep(make_ctx()))
    ctx = make_ctx()
    ctx.generator = torch.Generator().manual_seed(123)
    assert not torch.equal(a, build("vase").keep(ctx))


# -- TriAttention -----------------------------------------------------------------------------------
def tri_ctx():
    # d=4, "half" pairs (x0, x2) and (x1, x3): key 0 has pair norms (5, 0), key 1 has (0, 1).
    keys = torch.tensor([[[3.0, 0.0, 4.0, 0.0], [0.0, 1.0, 0.0, 0.0]]])
    return EvictionContext(positions=torch.tensor([[2, 5]]), budget=1, prompt_len=0, keys=keys, query_position=6)


TRI = TriAttentionCalibration(cos_coef=torch.tensor([[[1.0, 0.5]]]), sin_coef=torch.tensor([[[0.0, 2.0]]]),
                              norm_weight=torch.tensor([[[0.1, 0.2]]]), omega=torch.tensor([1.0, 0.25]))


def f(delta):  # Σ_m a_m cos(ω_m Δ) + b_m sin(ω_m Δ) for TRI
    return math.cos(delta) + 0.5 * math.cos(0.25 * delta) + 2.0 * math.sin(0.25 * delta)


def test_triattention_score_by_hand():
    ctx = tri_ctx()  # distances 4 and 1
    pol = build("triattention", calibration=TRI, layer=None, max_offset=0, protect_prompt=False)
    assert torch.allclose(pol.score(ctx), torch.tensor([[f(4) + 0.1 * 5, f(1) + 0.2 * 1]], dtype=torch.float64))
    pol = build("triattention", calibration=TRI, layer=None, max_offset=2, protect_prompt=False)  # offsets {1, 2}
    want = [(f(5) + f(6)) / 2 + 0.5, (f(2) + f(3)) / 2 + 0.2]
    assert torch.allclose(pol.score(ctx), torch.tensor([want], dtype=torch.float64))
    assert pol.keep(ctx).tolist() == [[0 if want[0] > want[1] else 1]]
    ctx.extras["triattention"] = None
    with pytest.raises(PolicyError, match="calibration"):
        build("triattention", calibration=None).keep(ctx)
    with pytest.raises(PolicyError, match="layer"):
        build("triattention", calibration=small_calibration(H=1, d=4), layer=None, protect_prompt=False).keep(tri_ctx())


def rope(x, pos, omega, style):
    """Independent RoPE: rotate pair m of x by omega_m * pos."""
    ang = pos * omega
    c, s = torch.cos(ang), torch.sin(ang)
    y = x.clone()
    if style == "half":
        M = x.shape[-1] // 2
        y[..., :M] = x[..., :M] * c - x[..., M:] * s
        y[..., M:] = x[..., M:] * c + x[..., :M] * s
    else:
        y[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        y[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return y


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_triattention_calibration_reproduces_rope_logits(style):
    """With constant samples the series must equal the mean RoPE logit of the group's queries and the
    key, at any pair of positions; the norm weight is then zero."""
    g = torch.Generator().manual_seed(0)
    d, theta = 8, 500.0
    qs = torch.randn(2, d, generator=g, dtype=torch.float64)  # two query heads for one KV head
    k = torch.randn(d, generator=g, dtype=torch.float64)
    cal = calibrate_from_samples(qs.unsqueeze(1).expand(2, 5, d), k.view(1, 1, d).expand(1, 7, d), theta, d, rope_style=style)
    assert cal.cos_coef.shape == (1, 1, d // 2) and torch.allclose(cal.norm_weight, torch.zeros(1, 1, d // 2), atol=1e-6)
    omega = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    for t, p in [(10, 3), (100, 99), (1000, 0), (57, 57)]:
        logit = torch.stack([rope(q, t, omega, style) @ rope(k, p, omega, style) for q in qs]).mean()
        assert math.isclose(cal.series(0, torch.tensor([t - p])).item(), logit.item(), rel_tol=1e-4, abs_tol=1e-4)


def test_triattention_norm_weight_by_hand(tmp_path):
    # Query samples q and -q: mean 0, so beta_m = E|q_m| = |q_m|; keys irrelevant here.
    q = torch.tensor([3.0, 1.0, 4.0, 0.0])  # half pairs: (3, 4) -> 5, (1, 0) -> 1
    cal = calibrate_from_samples(torch.stack([q, -q]).view(1, 2, 4), torch.ones(1, 3, 4), 10000.0, 4)
    assert torch.allclose(cal.norm_weight, torch.tensor([[[5.0, 1.0]]]))
    assert torch.allclose(cal.cos_coef, torch.zeros(1, 1, 2), atol=1e-7)
    assert torch.allclose(cal.omega, torch.tensor([1.0, 0.01]))
    save_calibration(cal, tmp_path / "c.safetensors")
    back = load_calibration(tmp_path / "c.safetensors")
    assert back.rope_style == "half" and back.rope_theta == 10000.0
    for name in ("cos_coef", "sin_coef", "norm_weight", "omega"):
        assert torch.equal(getattr(back, name), getattr(cal, name))
    pol = make_policy("triattention", calibration=str(tmp_path / "c.safetensors"))
    assert torch.equal(pol.calibration.norm_weight, cal.norm_weight)


# -- diversity-aware MMR ------------------------------------------------------------------------------
def test_mmr_admission_order_by_hand():
    """s~ = [1, .95, .9, .5]; k1 nearly parallel to k0 (cos 0.995), k2 orthogonal, k3 opposite (clamped 0).
    lambda2=-0.15: admits 0, then 2 (0.9 > 0.95 - 0.15*0.995 = 0.801), then 1 (0.801 > 0.5)."""
    score = torch.tensor([[1.0, 0.95, 0.9, 0.5]])
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [-1.0, 0.0]]])
    unit = keys / keys.norm(dim=-1, keepdim=True)
    pool = torch.ones(1, 4, dtype=torch.bool)

    def admitted(n, lam):
        return mmr_admit(score, unit, pool, torch.tensor([n]), lam)[0].nonzero().flatten().tolist()

    assert [admitted(n, -0.15) for n in (1, 2, 3)] == [[0], [0, 2], [0, 1, 2]]
    assert admitted(3, 0.0) == [0, 1, 2]
    assert admitted(3, -0.6) == [0, 2, 3]  # 0.95 - 0.6*0.995 = 0.353 < 0.5
    assert admitted(2, 0.3) == [0, 1]  # lambda2 > 0 rewards similarity
    assert admitted(3, -0.15) != admitted(3, -0.6)


def test_diverse_base_score_by_hand():
    """d=1, two window queries: q=0 gives [.5, .5]; q=ln3 on keys [1, 0] gives [.75, .25].
    mu = [.625, .375], sigma (ddof 1) = .25/sqrt2 for both."""
    ctx = EvictionContext(positions=torch.arange(2).unsqueeze(0), budget=1, prompt_len=0,
                          keys=torch.tensor([[[1.0], [0.0]]]), queries=torch.tensor([[[0.0], [math.log(3)]]]))
    pol = build("diverse", window=2)
    sig = 0.25 / math.sqrt(2)
    assert torch.allclose(pol.base_score(ctx, 0.0), torch.tensor([[0.625, 0.375]]))
    assert torch.allclose(pol.base_score(ctx, 0.7), torch.tensor([[0.625 + 0.7 * sig, 0.375 + 0.7 * sig]]))


def test_diverse_policy_drops_duplicates_with_strong_penalty():
    """Keys 0-2 identical and most attended, 3 half-aligned, 4 orthogonal, 5 opposite. lambda2=0 keeps the
    duplicates; lambda2=-2 admits 0, then 4 (corr 0), then 5 (corr 0 after clamping)."""
    keys = torch.tensor([[1.0, 0.0]] * 3 + [[0.5, 0.8], [0.0, 1.0], [-1.0, 0.0]]).unsqueeze(0)
    ctx = EvictionContext(positions=torch.arange(6).unsqueeze(0), budget=3, prompt_len=0, keys=keys,
                          queries=torch.tensor([[[4.0 * math.sqrt(2), 0.0]] * 2]))
    assert build("diverse", sinks=0, a2=(0.0,)).keep(ctx).tolist() == [[0, 1, 2]]
    assert build("diverse", sinks=0).keep(ctx).tolist() == [[0, 1, 2]]  # global lambda2 = -0.15 is too weak here
    assert build("diverse", sinks=0, a2=(math.asinh(-2.0),)).keep(ctx).tolist() == [[0, 4, 5]]
    # The pool is the top 4B by base score: with pool_factor=1 only the duplicates are candidates.
    assert build("diverse", sinks=0, a2=(math.asinh(-2.0),), pool_factor=1).keep(ctx).tolist() == [[0, 1, 2]]


def test_depth_profiles_map_layers_to_lambda():
    assert depth_lambda("global", (0.5,), 7, 32) == pytest.approx(math.sinh(0.5))
    seg = (0.1, -0.2, 0.3)
    got = [depth_lambda("segments", seg, layer, 32) for layer in (0, 10, 11, 21, 22, 31)]
    assert got == pytest.approx([math.sinh(a) for a in (0.1, 0.1, -0.2, -0.2, 0.3, 0.3)])
    curve = (0.2, 0.5, -1.0)  # x = -1, -.5, 0, .5, 1 for L = 5
    got = [depth_lambda("curve", curve, layer, 5) for layer in range(5)]
    assert got == pytest.approx([math.sinh(a) for a in (-1.3, -0.3, 0.2, 0.2, -0.3)])
    assert depth_lambda("global", (2.0,), 0, 1) == pytest.approx(3.6269, abs=1e-4)  # "lambda in [-3.6, 3.6]"
    pol = build("diverse", profile="segments", a1=(0.0, 0.4, 0.0), a2=(-0.1, 0.0, 0.2))
    ctx = make_ctx()
    ctx.extras = {"layer": 5, "num_layers": 12}  # middle third
    assert pol.lambdas(ctx) == pytest.approx((math.sinh(0.4), 0.0))
    ctx.extras = {}
    with pytest.raises(PolicyError, match="layer"):
        pol.keep(ctx)
    with pytest.raises(PolicyError, match="profile"):
        build("diverse", profile="curve", a1=(0.1,))


# -- protection over many rounds ----------------------------------------------------------------------
def run_rounds(name, protect, rounds=25, prompt_len=10, K=24, r=8, H=2, Hq=4, d=8, seed=0):
    """Decode with a DenseHeadCache; the prompt is made unattractive to every score (keys anti-aligned
    with the queries and tiny, constant values, zero H2O attention). Returns the prompt positions lost."""
    g = torch.Generator().manual_seed(seed)
    sched = EvictionSchedule(budget=K, buffer=r)
    cache = DenseHeadCache(H, d, sched.max_cached)
    direction = torch.zeros(d)
    direction[0] = 1.0
    cache.append(-0.05 * direction.expand(H, prompt_len, d), torch.zeros(H, prompt_len, d), 0)
    pol = build(name, protect_prompt=protect, sinks=0)
    cal = small_calibration(H=H, d=d)
    cal.norm_weight.fill_(1.0)  # TriAttention: the key norm term ranks tiny prompt keys last
    extras = {"triattention": cal, "layer": 1, "num_layers": 4}
    lost, rounds_done, step = set(), 0, 0
    while rounds_done < rounds:
        pos = prompt_len + step
        cache.append(torch.randn(H, 1, d, generator=g), torch.randn(H, 1, d, generator=g), pos)
        step += 1
        if not sched.due(cache.length, step):
            continue
        n_cand = sched.num_candidates(cache.length)
        cand = cache.positions[:, :n_cand].sort(dim=1).values
        attention = torch.rand(H, n_cand, generator=g).masked_fill(cand < prompt_len, 0.0)
        queries = 3.0 * direction + 0.3 * torch.randn(Hq, 8, d, generator=g)
        cache.evict_round(pol, sched, prompt_len, queries=queries, attention=attention, query_position=pos,
                          generator=g, extras=extras)
        kept = cache.kept_positions(sched.buffer)
        assert kept.shape == (H, K) and cache.length == K + r
        lost |= {p for h in range(H) for p in range(prompt_len) if p not in set(kept[h].tolist())}
        rounds_done += 1
    return lost


@pytest.mark.parametrize("name", SCORED)
def test_prompt_survives_many_rounds_when_protected(name):
    assert run_rounds(name, protect=True) == set()
    assert run_rounds(name, protect=False), "control: without protection the unattractive prompt is evicted"


def test_triattention_scores_a_tensor_parallel_slice_of_heads_with_their_calibration_rows():
    """A rank holding KV heads [2, 4) of a 4-head calibration (ctx.extras["kv_heads"]) scores them exactly
    as the full 4-head context scores those rows; a head index past the calibration is an error."""
    from dataclasses import replace

    policy = build("triattention", calibration=small_calibration(H=4))
    full = make_ctx(H=4, Hq=8)
    part = replace(full, positions=full.positions[2:], keys=full.keys[2:], values=full.values[2:],
                   queries=full.queries[4:], attention=full.attention[2:],
                   extras={**full.extras, "kv_heads": torch.tensor([2, 3])})
    assert torch.equal(policy.score(part), policy.score(full)[2:])
    with pytest.raises(PolicyError, match="do not fit"):
        policy.score(replace(part, extras={**part.extras, "kv_heads": torch.tensor([3, 4])}))


# -- window attention: causal, and any query strides ---------------------------------------------------
def window_scores(pol, ctx):
    return pol.base_score(ctx, 0.5) if pol.name == "diverse" else pol.score(ctx)


@pytest.mark.parametrize("name", ["snapkv", "rkv", "vase", "diverse"])
@pytest.mark.parametrize("layout", ["window_slice", "transposed"])
@pytest.mark.parametrize("with_buffer", [False, True])
def test_window_scores_take_noncontiguous_float32_queries(name, layout, with_buffer):
    """The reference engine stores fp32 queries and hands a slice of its longer store; with GQA (here 2
    query heads per KV head) the policy's window slice is not contiguous and .float() does not copy fp32.
    Scores and keep-sets must equal those of the contiguous copy exactly."""
    def ctx_with(queries):
        ctx = make_ctx(w=12)
        ctx.queries = queries
        if with_buffer:
            ctx.buffer_keys = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(5))
        return ctx

    stored = make_ctx(w=12).queries  # [4, 12, 8] fp32; the policies read the last 8 (window=8)
    if layout == "window_slice":
        strided, dense = stored, stored[:, -8:].contiguous()
        assert not strided[:, -8:].is_contiguous()
    else:  # a [w, H_q, d] store read as [H_q, w, d]
        strided = stored[:, -8:].transpose(0, 1).contiguous().transpose(0, 1)
        dense = stored[:, -8:].contiguous()
        assert not strided.is_contiguous() and torch.equal(strided, dense)
    assert strided.dtype == torch.float32
    pol = build(name, window=8)
    assert torch.equal(window_scores(pol, ctx_with(strided)), window_scores(pol, ctx_with(dense)))
    assert torch.equal(pol.keep(ctx_with(strided)), pol.keep(ctx_with(dense)))


def causal_reference(keys, positions, buffer_keys, queries, query_position, causal=True):
    """[H, S] Σ over the window of each query's causal softmax attention on the candidates, averaged over
    the query group: the model's own attention, token by token, in float64 (causal=False: every key)."""
    H, S, d = keys.shape
    r, (Hq, w, _) = buffer_keys.shape[1], queries.shape
    group = Hq // H
    out = torch.zeros(H, S, dtype=torch.float64)
    for h in range(H):
        k = torch.cat([keys[h], buffer_keys[h]]).double()
        pos = torch.cat([positions[h], torch.arange(query_position - r + 1, query_position + 1)])
        for g in range(group):
            for i in range(w):
                t = query_position - (w - 1 - i)
                logits = k @ queries[h * group + g, i].double() / math.sqrt(d)
                if causal:
                    logits = logits.masked_fill(pos > t, float("-inf"))
                out[h] += torch.softmax(logits, dim=0)[:S] / group
    return out


@pytest.mark.parametrize("w, r, with_position", [(6, 8, False), (6, 8, True), (8, 8, True), (8, 3, True)])
def test_snapkv_window_attention_equals_the_causal_model_attention(w, r, with_position):
    """Against a token-by-token causal softmax: window queries never see a newer buffer key, and (window
    longer than the buffer, query_position given) never a newer candidate."""
    g = torch.Generator().manual_seed(1)
    H, Hq, d, S = 2, 4, 8, 30
    qp = 100
    # candidates: distinct positions below the buffer, the newest just below it so w > r reaches them
    positions = torch.stack([torch.cat([torch.randperm(qp - r - 6, generator=g)[: S - 5].sort().values,
                                        torch.arange(qp - r - 5, qp - r)]) for _ in range(H)])
    ctx = EvictionContext(positions=positions, budget=10, prompt_len=0, keys=torch.randn(H, S, d, generator=g),
                          buffer_keys=torch.randn(H, r, d, generator=g), queries=2 * torch.randn(Hq, w, d, generator=g),
                          query_position=qp if with_position else None)
    got = build("snapkv", window=w, kernel=1).score(ctx)
    want = causal_reference(ctx.keys, positions, ctx.buffer_keys, ctx.queries, qp)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
    old = causal_reference(ctx.keys, positions, ctx.buffer_keys, ctx.queries, qp, causal=False)
    assert not torch.allclose(got.double(), old, rtol=1e-3, atol=1e-4), "the mask must matter in this example"


# -- the three choices that differ from kvpress / R-KV, pinned against hand computations (issue #25) ------
def _ctx_from_logits(logits_per_query: list[list[float]], buffer_logits=None, group: int = 1):
    """A one-KV-head context with given window logits [G*w][S]: query row n is the unit vector e_n and key
    j holds every row's logit for it along those directions (times sqrt(d)), so q_n . k_j / sqrt(d) is
    logits[n][j]; buffer keys likewise."""
    rows = len(logits_per_query)
    S = len(logits_per_query[0])
    d = rows
    keys = torch.tensor(logits_per_query, dtype=torch.float64).T.reshape(1, S, d) * d ** 0.5
    queries = torch.eye(d, dtype=torch.float64).reshape(group, rows // group, d)   # [G, w, d] for H = 1
    buf = None
    if buffer_logits is not None:
        buf = torch.tensor(buffer_logits, dtype=torch.float64).T.reshape(1, -1, d) * d ** 0.5
    return EvictionContext(positions=torch.arange(S).view(1, S), budget=2, prompt_len=0, keys=keys,
                           queries=queries, buffer_keys=buf)


def test_snapkv_max_pools_as_snapkv_and_rkv_not_average_pools_as_kvpress():
    logits = [[0.0, 3.0, 0.0, 0.0, 0.0, 1.0]]
    ctx = _ctx_from_logits(logits)
    a = torch.softmax(torch.tensor(logits[0], dtype=torch.float64), 0)
    want = torch.stack([a[max(i - 1, 0): i + 2].max() for i in range(6)])                    # kernel 3, max
    kvpress = torch.nn.functional.avg_pool1d(a.view(1, 1, -1), 3, 1, 1, count_include_pad=False).view(-1)
    got = SnapKVPolicy(window=1, kernel=3).score(ctx)[0].double()
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, kvpress, atol=1e-3)


def test_snapkv_averages_the_query_group_before_pooling():
    """G = 2 query heads of one KV head peaking at different candidates: pool(mean) != mean(pool)."""
    logits = [[4.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]]
    ctx = _ctx_from_logits(logits, group=2)
    a = torch.softmax(torch.tensor(logits, dtype=torch.float64), 1)                             # [G, S]

    def maxpool(x):
        return torch.stack([x[max(i - 1, 0): i + 2].max() for i in range(len(x))])

    ours, kvpress_order = maxpool(a.mean(0)), (maxpool(a[0]) + maxpool(a[1])) / 2
    got = SnapKVPolicy(window=1, kernel=3).score(ctx)[0].double()
    assert torch.allclose(got, ours, atol=1e-6) and not torch.allclose(got, kvpress_order, atol=1e-3)


def test_rkv_softmax_covers_the_buffer_keys_and_differs_from_rkvs_for_two_window_queries():
    """ŝ: per-query softmax over candidates + buffer keys, summed over the window, max-pooled, mean 1.
    One window query: the same ranking as R-KV's candidates-only softmax; two queries with different
    mass on the buffer: a different ranking."""
    cand = [[2.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 1.2]]                 # two window queries (older, newer)
    buf = [[0.0, 9.9], [4.0, 0.0]]                                       # r = 2 buffer keys, the newest = query 2
    policy = make_policy("rkv", window=2, kernel=1)

    def hand(rows, buffer):
        """Causal: window query t (of w) sees the buffer keys not newer than itself, buffer[:r - (w-1-t)]."""
        w, r = len(rows), len(buffer[0])
        sm = [torch.softmax(torch.tensor(row + b[: r - (w - 1 - t)], dtype=torch.float64), 0)[: len(row)]
              for t, (row, b) in enumerate(zip(rows, buffer))]
        s = torch.stack(sm).sum(0)
        return s / s.mean()

    got = policy.importance(_ctx_from_logits(cand, buffer_logits=buf))[0].double()
    assert torch.allclose(got, hand(cand, buf), atol=1e-6)
    rkv_own = hand(cand, [[], []])                                       # R-KV: candidates only
    assert got.argsort().tolist() != rkv_own.argsort().tolist()
    one = make_policy("rkv", window=1, kernel=1).importance(_ctx_from_logits(cand[:1], buffer_logits=buf[:1]))[0]
    assert one.double().argsort().tolist() == hand(cand[:1], [[]]).argsort().tolist()
