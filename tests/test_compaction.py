"""Compaction: attention over the compacted cache equals full attention with evicted positions masked
per head, for hole filling and the full gather, over many consecutive rounds."""

import pytest
import torch

from kvtier.policies import (DenseHeadCache, EvictionSchedule, PolicyError, full_gather_plan, hole_fill_plan,
                             make_policy)
from kvtier.policies.compaction import apply_plan_dense


def masked_reference(all_k, all_v, alive, q):
    """Full attention over every position ever cached, evicted ones masked per KV head."""
    H, N, d = all_k.shape
    group = q.shape[0] // H
    logits = q.view(H, group, d) @ all_k.transpose(1, 2) / d**0.5
    logits = logits.masked_fill(~alive[:, :N].unsqueeze(1), float("-inf"))
    return (torch.softmax(logits, -1) @ all_v).view(H * group, d)


@pytest.mark.parametrize("name", ["random", "random_shared", "random_block", "recency", "snapkv", "streaming"])
@pytest.mark.parametrize("gather", [False, True])
def test_compacted_attention_equals_masked_full_attention(name, gather):
    torch.manual_seed(0)
    H, Hq, d, K, r, lp, steps = 2, 4, 16, 24, 8, 5, 200
    sched = EvictionSchedule(budget=K, buffer=r)
    cache = DenseHeadCache(H, d, sched.max_cached, dtype=torch.float64)
    pol = make_policy(name)
    gen = torch.Generator().manual_seed(7)
    all_k = torch.randn(H, lp + steps, d, dtype=torch.float64)
    all_v = torch.randn(H, lp + steps, d, dtype=torch.float64)
    alive = torch.zeros(H, lp + steps, dtype=torch.bool)
    cache.append(all_k[:, :lp], all_v[:, :lp], 0)
    alive[:, :lp] = True
    queries = []
    rounds = 0
    for t in range(steps):
        p = lp + t
        cache.append(all_k[:, p : p + 1], all_v[:, p : p + 1], p)
        alive[:, p] = True
        q = torch.randn(Hq, d, dtype=torch.float64)
        queries.append(q)
        assert cache.length <= sched.max_cached
        torch.testing.assert_close(cache.attend(q), masked_reference(all_k, all_v, alive, q), rtol=1e-9, atol=1e-9)
        if sched.due(cache.length, t + 1):
            window = torch.stack(queries[-8:], dim=1)
            cache.evict_round(pol, sched, lp, gather=gather, generator=gen, queries=window)
            kept = cache.kept_positions(sched.buffer)
            rounds += 1
            assert cache.length == sched.settled_len
            new_alive = torch.zeros_like(alive)
            new_alive.scatter_(1, cache.positions[:, : cache.length], True)
            assert (new_alive <= alive).all(), "eviction is monotonic"
            alive = new_alive
            # the slot map names exactly the survivors: unique, and kept = survivors minus the buffer
            held = cache.positions[:, : cache.length]
            assert all(len(set(row.tolist())) == cache.length for row in held)
            assert (cache.positions[:, cache.length :] == -1).all()
            assert kept.shape == (H, K)
            assert torch.equal(kept, held.sort(1).values[:, :K])
            assert set(range(p - r + 1, p + 1)) <= set(held[0].tolist()), "the recent buffer is never evicted"
            if pol.protect_prompt:
                assert (alive[:, :lp]).all()
            # values travel with their keys
            for h in range(H):
                torch.testing.assert_close(cache.keys[h, : cache.length], all_k[h, held[h]])
                torch.testing.assert_close(cache.values[h, : cache.length], all_v[h, held[h]])
    assert rounds >= 15


def test_hole_fill_moves_at_most_the_tail():
    evicted = torch.tensor([[1, 4, 9], [7, 8, 9]])  # L = 10, e = 3, new_len = 7
    plan = hole_fill_plan(evicted, 10)
    assert plan.new_len == 7
    # head 0: holes 1, 4 get tail survivors 7, 8; slot 9 was dead (dummy pair dead->dead)
    assert plan.dst[0].tolist() == [1, 4, 9] and plan.src[0].tolist() == [7, 8, 9]
    # head 1: the dead slots are exactly the tail; nothing real moves
    assert (plan.dst[1] >= 7).all() and (plan.src[1] >= 7).all()
    x = torch.arange(20.0).view(2, 10, 1).clone()
    apply_plan_dense(x, plan)
    assert x[0, :7, 0].tolist() == [0, 7, 2, 3, 8, 5, 6]
    assert x[1, :7, 0].tolist() == [10, 11, 12, 13, 14, 15, 16]


def test_full_gather_plan_orders_survivors():
    plan = full_gather_plan(torch.tensor([[0, 2, 5]]), 6)
    x = torch.arange(6.0).view(1, 6, 1).clone()
    apply_plan_dense(x, plan)
    assert plan.new_len == 3 and x[0, :3, 0].tolist() == [0, 2, 5]


def test_schedule_cadence_and_bounds():
    s = EvictionSchedule(budget=256, buffer=64)
    assert s.max_cached == 384 and s.settled_len == 320
    # prompt of 100: the first round is at decode step 256 (length 356 > 320), evicting 36
    due = [n for n in range(1, 700) if s.due(100 + n - (0), n)]
    assert due[0] == 256 and s.num_evicted(356) == 36
    assert not s.due(320, 64) and not s.due(383, 63)
    assert s.due(384, 63) and s.due(400, 1)   # catch-up at K + 2r, off the cadence
    with pytest.raises(PolicyError, match="buffer"):
        EvictionSchedule(budget=4, buffer=0)
    with pytest.raises(PolicyError, match="budget"):
        EvictionSchedule(budget=0)
