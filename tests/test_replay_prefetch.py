"""The learner replay's background derivation (kvtier.rollout.replay_prefetch): a forward reading through the
prefetcher gets exactly a fresh derivation's deaths, every sample is derived once per step (by the pool, or by
the forward when no worker has started it), the next step starts the store over, and no more results than the
pool's bound wait outside the store. No timings asserted (`kvtier bench replay-memory` measures them)."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from kvtier.deathtime.store import DeathStore
from kvtier.rollout.replay_batch import micro_batch_deaths, replayed_samples
from kvtier.rollout.replay_prefetch import Prefetcher

pytestmark = pytest.mark.usefixtures("single_torch_thread")
FIELDS = {"kvtier_budget": 24, "kvtier_buffer": 8, "kvtier_policy": "random", "kvtier_policy_params": None,
          "kvtier_preemptions": 0, "kvtier_generate_calls": 1}
SHAPE = dict(num_layers=4, num_kv_heads=2)


def _batch(seeds, length=150, prompt=20):
    td = TensorDict({"input_ids": torch.nested.nested_tensor([torch.zeros(length, dtype=torch.long)] * len(seeds),
                                                             layout=torch.jagged)}, batch_size=[len(seeds)])
    td["prompts"] = torch.nested.nested_tensor([torch.zeros(prompt, dtype=torch.long)] * len(seeds), layout=torch.jagged)
    td["extra_fields"] = [{**FIELDS, "kvtier_seed": s} for s in seeds]
    return td


def _one(batch, b):
    return _batch([batch["extra_fields"][b]["kvtier_seed"]])


def _wait(pool, timeout=60.0):
    t0 = time.monotonic()
    while (pool._running or pool._queued) and time.monotonic() - t0 < timeout:
        if pool._queued and pool._running + len(pool._held) >= pool.workers + pool.window:
            return
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_forwards_through_the_prefetcher_get_fresh_deaths_derived_once_per_step(kind):
    """Three passes (reference, old log-probs, update) over four samples, store room for two: the pool derives
    all four once in the first pass; stored ones are hits later, the other two are derived again each pass
    (by the pool when queued again, else by the forward); every micro-batch equals a store-less derivation."""
    batch = _batch([1, 2, 3, 4])
    fresh = [micro_batch_deaths(_one(batch, b), 150, packed=False, **SHAPE, store=DeathStore(0))[0] for b in range(4)]
    one = DeathStore(1 << 30)
    micro_batch_deaths(_one(batch, 0), 150, packed=False, **SHAPE, store=one)
    store = DeathStore(2 * one.bytes)
    pool = Prefetcher(store, workers=2, kind=kind)
    try:
        for _ in range(3):
            pool.prefetch(replayed_samples(batch, **SHAPE))
            for b in range(4):
                got, counts = micro_batch_deaths(_one(batch, b), 150, packed=False, **SHAPE, store=pool)
                assert counts["replayed"] == 1 and torch.equal(got, fresh[b])
        assert store.bytes == 2 * one.bytes and store.hits >= 2 * 2     # + the first pass's, when the pool was first
        assert store.derived == 4 + 2 * 2 == pool.prefetched + pool.inline
        # the next step: new samples after repeated ones start the store over; in-flight work of the old is dropped
        nxt = _batch([7, 8])
        pool.prefetch(replayed_samples(nxt, **SHAPE))
        want = micro_batch_deaths(_one(nxt, 1), 150, packed=False, **SHAPE, store=DeathStore(0))[0]
        assert torch.equal(micro_batch_deaths(_one(nxt, 1), 150, packed=False, **SHAPE, store=pool)[0], want)
        _wait(pool)
        assert store.step == 1 and store.bytes <= 2 * one.bytes
    finally:
        pool.shutdown()


def test_results_that_do_not_fit_wait_within_the_pools_bound():
    """A store with no room: at most workers + window derived results wait for their forwards; taking one
    lets the pool start the next; every sample is still served once, equal to a fresh derivation."""
    batch = _batch(list(range(6)))
    store = DeathStore(0)
    pool = Prefetcher(store, workers=1, kind="thread", window=1)
    try:
        pool.prefetch(replayed_samples(batch, **SHAPE))
        _wait(pool)
        assert len(pool._held) + pool._running <= 2 and len(pool._queued) == 4
        for b in range(6):
            got, _ = micro_batch_deaths(_one(batch, b), 150, packed=False, **SHAPE, store=pool)
            want, _ = micro_batch_deaths(_one(batch, b), 150, packed=False, **SHAPE, store=DeathStore(0))
            assert torch.equal(got, want)
            assert len(pool._held) + pool._running <= 2
        assert store.derived == 6 == pool.prefetched + pool.inline
    finally:
        pool.shutdown()
