"""`random_line_reserve`: protected prompt, once-stated lines found at write time from the first layer's keys
and kept with their span in every layer and head, a uniform draw for the rest. Pure torch except the last
test (the reference engine on the tiny model); the vLLM engine's run: tests/test_engine_policies.py."""

import dataclasses

import pytest
import torch

from kvtier.policies import DenseHeadCache, EvictionContext, EvictionSchedule, PolicyError, complement, make_policy
from kvtier.policies.random import sample_free

NAME = "random_line_reserve"
L, H, D, R, K, P = 2, 3, 16, 8, 40, 4        # layers, KV heads, head_dim, buffer r, budget, prompt
PLANTED = 47                                  # the once-stated token's position


def token_keys(T: int, planted: int | None, seed: int = 0) -> torch.Tensor:
    """[L*H, T, D] keys, layers stacked (row l*H + h): the first layer's keys are a 2-token vocabulary
    cycling (every token recurs within r) plus noise, except a unique direction at `planted`; the other
    layers' keys are noise (the policy must not read them)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L * H, T, D, generator=g)
    vocab = torch.eye(D)[torch.arange(T) % 2]
    keys[:H] = vocab + 0.05 * torch.randn(H, T, D, generator=g)
    if planted is not None:
        keys[:H, planted] = torch.eye(D)[7] + 0.05 * torch.randn(H, D, generator=g)
    return keys


def run_schedule(keys: torch.Tensor, pol, seed: int = 0, state: dict | None = None, upto: int | None = None):
    """Prefill P tokens, then decode the rest on the engines' schedule (one call for all layers, as the
    vLLM worker); returns the cache."""
    sched = EvictionSchedule(K, R)
    rows, T, _ = keys.shape
    cache = DenseHeadCache(rows, D, K + 2 * R + 1)
    cache.append(keys[:, :P], keys[:, :P], 0)
    g, after = torch.Generator().manual_seed(seed), False
    state = {} if state is None else state
    for t in range(P, upto or T):
        if sched.due(cache.length, t - P, after):
            cache.evict_round(pol, sched, P, generator=g, query_position=t - 1,
                              extras={"num_layers": L, "state": state})
            assert cache.length == K + R and cache.kept_positions(R).shape == (rows, K)   # K per row
            after = True
        cache.append(keys[:, t : t + 1], keys[:, t : t + 1], t)
    return cache


def test_registered_with_its_parameters():
    pol = make_policy(NAME, reserve=0.2, span=3)
    assert pol.params() == {"protect_prompt": True, "sinks": 0, "reserve": 0.2, "span": 3}
    assert pol.needs == {"keys", "buffer_keys"} and pol.order_free and pol.width == 7
    assert make_policy(NAME).params() == {"protect_prompt": True, "sinks": 0, "reserve": 0.1, "span": 5}
    assert pol.num_anchors(512, 19) == 14 and make_policy(NAME).num_anchors(512, 19) == 4
    assert make_policy(NAME).num_anchors(24, 19) == 0                  # one span does not fit K − p
    assert make_policy(NAME, reserve=0.0).num_anchors(512, 19) == 0


@pytest.mark.parametrize("bad", [{"reserve": 1.0}, {"reserve": -0.1}, {"reserve": "x"}, {"reserve": float("nan")},
                                 {"span": -1}, {"span": 2.5}, {"span": "3"}, {"span": True}])
def test_bad_parameters_refused_by_name(bad):
    with pytest.raises(PolicyError, match=next(iter(bad))):
        make_policy(NAME, **bad)


def test_a_once_stated_line_is_kept_whole_in_every_layer_and_head():
    """Over ~40 rounds the planted token's span stays in all L·H rows (random keeps ~a third of each
    old position per row, so the whole span in every row by chance is ~never); prompt kept."""
    pol = make_policy(NAME, reserve=0.3, span=2)                          # m = ⌊0.3·36/5⌋ = 2 anchors
    state: dict = {}
    cache = run_schedule(token_keys(400, PLANTED), pol, state=state)
    held = cache.kept_positions(R)
    span = set(range(PLANTED - 2, PLANTED + 3))
    for row in held.tolist():
        assert set(range(P)) | span <= set(row)
    assert PLANTED in state[NAME]["pos"].tolist()
    control = run_schedule(token_keys(400, PLANTED), make_policy("random")).kept_positions(R)
    assert sum(span <= set(row) for row in control.tolist()) < L * H


def test_each_token_is_scored_once(monkeypatch):
    """The first round scores every unprotected position up to the newest; every later round only the r
    positions written since (the buffer); a second call in the same round (the reference engine's next
    layer) scores nothing and changes nothing."""
    import kvtier.policies.random_line_reserve as mod

    scored: list[int] = []
    original = mod.window_novelty
    monkeypatch.setattr(mod, "window_novelty", lambda keys, present, r: scored.append(keys.shape[1]) or
                        original(keys, present, r))
    pol = make_policy(NAME, reserve=0.3, span=2)
    state: dict = {}
    cache = run_schedule(token_keys(200, PLANTED), pol, state=state)
    assert len(scored) > 10 and scored[0] > R and set(scored[1:]) == {R}
    assert scored[0] + R * (len(scored) - 1) == state[NAME]["seen"] + 1 - P
    before, calls = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state[NAME].items()}, len(scored)
    ctx, _ = cache.context(pol, EvictionSchedule(K, R), P, query_position=state[NAME]["round"],
                           extras={"layer": 1, "state": state})
    pol.reserved_positions(ctx)
    assert len(scored) == calls
    assert all(torch.equal(v, state[NAME][k]) if torch.is_tensor(v) else v == state[NAME][k] for k, v in before.items())


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_runs_are_exact_and_seeds_differ(seed):
    pol = make_policy(NAME, reserve=0.3, span=2)
    a = run_schedule(token_keys(200, PLANTED), pol, seed=seed).kept_positions(R)
    b = run_schedule(token_keys(200, PLANTED), pol, seed=seed).kept_positions(R)
    c = run_schedule(token_keys(200, PLANTED), pol, seed=seed + 7).kept_positions(R)
    assert torch.equal(a, b) and not torch.equal(a, c)


def single_round_ctx(rows_per_layer: int, seed: int, state=None) -> EvictionContext:
    """One round, stateless: S = 60 candidates (positions 0..59, chronological), the buffer 60..67."""
    S = 60
    keys = token_keys(S + R, 30, seed=seed)[:H].repeat(rows_per_layer // H + 1, 1, 1)[:rows_per_layer]
    return EvictionContext(positions=torch.arange(S).expand(rows_per_layer, S), budget=K, prompt_len=P,
                           keys=keys[:, :S], buffer_keys=keys[:, S:], query_position=S + R - 1,
                           generator=torch.Generator().manual_seed(seed),
                           extras={} if state is None else {"state": state})


def test_the_random_part_is_uniform_on_the_rest():
    """Protected and reserved kept always; every other candidate with probability (K − p − w)/(S − p − w)."""
    pol = make_policy(NAME, reserve=0.2, span=2)                          # m = 1: positions 28..32
    rows, S = 300, 60
    counts, draws = torch.zeros(S), 0
    for seed in range(10):
        ctx = single_round_ctx(rows, seed)
        keep = pol.keep(ctx)
        assert keep.shape == (rows, K) and (keep.diff(dim=1) > 0).all()
        assert torch.equal(pol.evict(single_round_ctx(rows, seed)), complement(keep, S))
        counts += torch.zeros(rows, S).scatter_(1, keep, 1.0).sum(dim=0)
        draws += rows
    freq = counts / draws
    reserved = list(range(28, 33))
    assert (freq[:P] == 1).all() and (freq[reserved] == 1).all()
    rest = [j for j in range(P, S) if j not in reserved]
    want = (K - P - 5) / (S - P - 5)                                      # 31/51; sd over 3000 draws ~0.009
    assert (freq[rest] - want).abs().max() < 0.045, freq


def test_stacked_and_per_layer_calls_agree():
    """The vLLM worker calls once with every layer stacked (extras num_layers), the reference engine once
    per layer in order (extras layer): the same anchors each round, and each keeps them in every row."""
    pol = make_policy(NAME, reserve=0.3, span=2)
    keys = token_keys(300, PLANTED)
    sched = EvictionSchedule(K, R)
    stacked = DenseHeadCache(L * H, D, K + 2 * R + 1)
    layers = [DenseHeadCache(H, D, K + 2 * R + 1) for _ in range(L)]
    s_state, l_state = {}, {}
    g = [torch.Generator().manual_seed(0) for _ in range(L + 1)]
    stacked.append(keys[:, :P], keys[:, :P], 0)
    for li, c in enumerate(layers):
        c.append(keys[li * H : (li + 1) * H, :P], keys[li * H : (li + 1) * H, :P], 0)
    after, rounds = False, 0
    for t in range(P, 300):
        if sched.due(stacked.length, t - P, after):
            stacked.evict_round(pol, sched, P, generator=g[L], query_position=t - 1,
                                extras={"num_layers": L, "state": s_state})
            for li, c in enumerate(layers):
                c.evict_round(pol, sched, P, generator=g[li], query_position=t - 1,
                              extras={"layer": li, "num_layers": L, "state": l_state})
            assert torch.equal(s_state[NAME]["pos"], l_state[NAME]["pos"])
            span = set((s_state[NAME]["pos"].unsqueeze(1) + torch.arange(-2, 3)).flatten().tolist())
            span = {p for p in span if P <= p <= t - 1 - R}
            for c in [stacked, *layers]:
                assert all(span <= set(row) for row in c.kept_positions(R).tolist())
            after, rounds = True, rounds + 1
        stacked.append(keys[:, t : t + 1], keys[:, t : t + 1], t)
        for li, c in enumerate(layers):
            c.append(keys[li * H : (li + 1) * H, t : t + 1], keys[li * H : (li + 1) * H, t : t + 1], t)
    assert rounds > 20 and PLANTED in s_state[NAME]["pos"].tolist()


def test_order_free():
    """Candidates in any slot order: the same reserve (positions, not slots, make the lines)."""
    pol = make_policy(NAME, reserve=0.2, span=2)
    ctx = single_round_ctx(H, 0)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(3))
    shuffled = dataclasses.replace(ctx, positions=ctx.positions[:, perm], keys=ctx.keys[:, perm])
    kept = shuffled.positions.gather(1, pol.keep(shuffled))
    assert all(set(range(P)) | set(range(28, 33)) <= set(row) for row in kept.tolist())


def test_sample_free_is_a_uniform_subset_of_the_free_slots():
    rows, n, k = 2000, 30, 5
    positions = torch.stack([torch.randperm(n) + 10 for _ in range(3)]).repeat(rows // 3 + 1, 1)[:rows]
    taken = torch.zeros(n + 11, dtype=torch.bool)
    taken[[10, 11, 20, 25]] = True
    for n_free_min in (26, 19):                                          # the draw; the top-k fallback (4k > 19)
        s = sample_free(positions, taken, k, n_free_min, torch.Generator().manual_seed(0))
        assert s.shape == (rows, k) and (s.diff(dim=1) > 0).all()
        got = positions.gather(1, s)
        assert not taken[got].any()
        hits = torch.zeros(n + 11).scatter_add_(0, got.flatten(), torch.ones(rows * k)) / rows
        free = [p for p in range(10, n + 10) if not taken[p]]
        assert (hits[free] - k / len(free)).abs().max() < 0.04, hits


def test_reference_engine_runs_it_and_keeps_the_reserve_everywhere(ref, tiny_model_dir, monkeypatch):
    """The reference engine hands the policy its per-sequence state: every round's reserved positions are
    held by every (layer, KV head) in that round's log, and the log-probs equal the masked replay."""
    from kvtier.engine.config import EvictionSpec
    from kvtier.policies.random_line_reserve import RandomLineReservePolicy
    from kvtier.reference import MaskedReplay, Request

    reserved: dict[int, set] = {}
    original = RandomLineReservePolicy.reserved_positions

    def spy(self, ctx):
        out = original(self, ctx)
        reserved.setdefault(ctx.query_position, set()).update(p for p in out.flatten().tolist() if p >= 0)
        return out

    monkeypatch.setattr(RandomLineReservePolicy, "reserved_positions", spy)
    prompt = list(range(10, 26))
    spec = EvictionSpec(policy=NAME, budget=48, buffer=16, seed=1, params={"reserve": 0.5, "span": 2})  # m = 3
    out = ref.generate([Request(prompt, spec, max_new_tokens=130)])[0]
    assert out.rounds >= 4 and len(reserved) == out.rounds
    for rec in out.records:
        kept = torch.tensor(rec["kept"])                                     # [L, H, K]
        assert (kept[..., : len(prompt)] == torch.arange(len(prompt))).all()
        mine = reserved[rec["query_position"]]
        assert all(mine <= set(row) for row in kept.flatten(0, 1).tolist())
    assert sum(bool(r) for r in reserved.values()) >= out.rounds - 1      # the first one's anchor may be in the buffer
    ids = prompt + out.token_ids
    err = (torch.tensor(out.logprobs) - MaskedReplay(tiny_model_dir).logprobs(ids, len(prompt), out.records, 16)).abs()
    assert err.max() < 1e-3
