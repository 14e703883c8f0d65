"""Replay by segment without an engine (issue #60 item 3): one call's segments from the engine's reset rows, the
client joining every call's record (`SampleCounters`), which samples are replayed by segment (`replay_status`),
and the learner's row plan: a forward row per segment that evicted, each token read from its own segment's
row, and each row's deaths (padded and packed). The learner against the masked reference on the vLLM
engine's samples: tests/test_learner_replay_segments.py."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest
import torch
from tensordict import TensorDict

from kvtier.deathtime import NEVER
from kvtier.deathtime.segments import Segment, call_segments, segment_deaths, segments_to_json
from kvtier.rollout.replay_batch import micro_batch_deaths, sample_deaths
from kvtier.rollout.replay_segments import sample_rows, take_index
from kvtier.rollout.replay_status import by_segment, replay_status
from kvtier.rollout.sample_counters import SampleCounters

pytestmark = pytest.mark.usefixtures("single_torch_thread")
SHAPE = dict(num_layers=4, num_kv_heads=2)
RANDOM = dict(seed=1, budget=24, buffer=8)


def _fields(segments=None, preemptions=0, calls=1, **change):
    f = {"kvtier_budget": 24, "kvtier_seed": 1, "kvtier_buffer": 8, "kvtier_policy": "random",
         "kvtier_policy_params": None, "kvtier_preemptions": preemptions, "kvtier_generate_calls": calls,
         "kvtier_segments": None if segments is None else segments_to_json(segments)}
    return {**f, **change}


def test_a_calls_segments_follow_the_engines_resets():
    """One segment from the prompt, one after each recompute ([reset_row, rounds_before]), rows ending where the
    next segment's begin; a recompute before any progress leaves no empty segment."""
    segs = call_segments(20, 200, [[99, 3], [150, 5], [150, 5]], **RANDOM)
    assert [(s.start, s.end, s.rounds_before, s.prompt_len) for s in segs] == [(20, 99, 0, 20), (100, 150, 3, 20),
                                                                             (151, 219, 5, 20)]
    assert call_segments(20, 50, [[19, 0]], **RANDOM) == [Segment(start=20, end=69, prompt_len=20, **RANDOM)]
    assert call_segments(20, 0, [], **RANDOM) == []


def test_sample_counters_concatenate_every_calls_segments():
    a, b = Segment(20, 99, 20, 1, 24, 8), Segment(120, 199, 120, 2, 24, 8, policy_params='{"protect_prefix": 20}')
    extra = {"kvtier_budget": 24, "kvtier_eviction_events": 1}
    c = SampleCounters()
    c.add({**extra, "kvtier_segments": segments_to_json([a])})
    c.add({**extra, "kvtier_segments": segments_to_json([b])})
    assert json.loads(c.totals()["kvtier_segments"]) == [asdict(a), asdict(b)]
    c.add({**extra, "kvtier_segments": None})           # a call with no record (full attention): none for the sample
    assert c.totals()["kvtier_segments"] is None
    old = SampleCounters()                              # a server without the field: no key, as before
    old.add(extra)
    assert "kvtier_segments" not in old.totals()
    # a later call's prompt must extend the context so far (prompt + generated, then a tool reply): one that does
    # not (the history re-tokenized) leaves the sample without a record, dense, not replayed on wrong segments
    good, bad = SampleCounters(), SampleCounters()
    for c, second in ((good, [5, 6, 7, 8, 9, 3]), (bad, [5, 6, 70, 8, 9, 3])):
        c.add({**extra, "kvtier_segments": segments_to_json([a])}, prompt_ids=[5, 6], token_ids=[7, 8])
        c.add({**extra, "kvtier_segments": segments_to_json([b])}, prompt_ids=second, token_ids=[4])
    assert json.loads(good.totals()["kvtier_segments"]) == [asdict(a), asdict(b)]
    assert bad.totals()["kvtier_segments"] is None


def test_rebuilt_and_multi_call_samples_with_a_record_are_replayed_by_segment():
    segs = [Segment(20, 99, 20, 1, 24, 8), Segment(100, 180, 20, 1, 24, 8, rounds_before=3)]
    assert replay_status(_fields(segs, preemptions=1)) == "replayed" and by_segment(_fields(segs, preemptions=1))
    assert replay_status(_fields(segs, calls=2)) == "replayed"
    assert replay_status(_fields(None, preemptions=1)) == "rebuilt"       # no record: dense, as before
    assert replay_status(_fields(None, calls=2)) == "multi_call"
    assert replay_status(_fields(segs[::-1], calls=2)) == "multi_call"    # out of order: not replayable
    assert replay_status(_fields([segs[0], Segment(**{**asdict(segs[1]), "policy": "snapkv"})], calls=2)) == "policy"
    assert replay_status(_fields(segs)) == "replayed" and not by_segment(_fields(segs))   # one cache: as before


def test_rows_take_each_token_from_its_own_segments_forward():
    """Three caches, the middle one after a call boundary with a gap (a tool reply): a row per segment that
    evicted, each fed up to its end + 1; tokens before a segment (the prompt, the gap) come from the next row,
    which saw them at full attention; the packed and padded death tensors hold each row's own deaths."""
    later = dict(prompt_len=106, seed=2, budget=24, buffer=8, policy_params='{"protect_prefix": 20}')
    segs = [Segment(20, 99, 20, 1, 24, 8), Segment(106, 159, **later), Segment(160, 230, **later, rounds_before=2)]
    rows = sample_rows(0, 240, segs)
    assert [(r.length, r.segment) for r in rows] == [(100, segs[0]), (160, segs[1]), (240, segs[2])]
    take = take_index(rows, [240])
    src = [0] * 99 + [1] * 60 + [2] * 81                  # token row i -> the forward row it is read from
    offsets = [0, 100, 260]
    assert take.tolist() == [offsets[r] + i for i, r in enumerate(src)]
    assert [(r.length, r.segment.end) for r in sample_rows(0, 150, segs)] == [(100, 99), (150, 150)]  # cut at 150
    quiet = Segment(20, 30, 20, 1, 24, 8)                 # no round: its rows are scored in the next forward
    assert [r.segment for r in sample_rows(0, 240, [quiet, segs[1]])] == [segs[1]]

    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)   # noqa: E731
    mb = TensorDict({"input_ids": nested([torch.arange(240), torch.arange(50)]),
                     "prompts": nested([torch.arange(20), torch.arange(20)])}, batch_size=[2])
    mb["extra_fields"] = [_fields(segs, calls=2), _fields(None)]
    rows = sample_rows(0, 240, segs) + sample_rows(1, 50, None)
    padded, counts = micro_batch_deaths(mb, 240, packed=False, rows=rows, **SHAPE)
    assert counts["replayed"] == 2 and padded.shape == (4, 4, 2, 240)
    assert torch.equal(padded, micro_batch_deaths(mb, 240, packed=False, **SHAPE)[0])     # the default rows
    for r, s in enumerate(segs):
        assert s.rounds() and torch.equal(padded[r, ..., : s.end], segment_deaths(s, s.end, **SHAPE))
        assert (padded[r, ..., s.end:] == NEVER).all()
    assert torch.equal(padded[3, ..., :50], sample_deaths(_fields(None), 20, 50, **SHAPE))
    packed, _ = micro_batch_deaths(mb, 560, packed=True, rows=rows, **SHAPE)
    own = segment_deaths(segs[1], segs[1].end, **SHAPE)     # row 1: columns 100..259, its keys from 159 on live on
    assert torch.equal(packed[0, ..., 100:259], torch.where(own == NEVER, 260, own + 100).to(torch.int32))
    assert (packed[0, ..., 259:260] == 260).all() and (packed[0, ..., 550:] == NEVER).all()


def test_the_background_workers_derive_each_segment_row_once_per_step():
    """A batch with a sample replayed by segment: the prefetch queues one derivation per forward row (segments
    keyed by themselves), and a forward reading through the pool gets a store-less derivation's tensor."""
    from kvtier.deathtime.store import DeathStore
    from kvtier.rollout.replay_batch import replayed_samples
    from kvtier.rollout.replay_prefetch import Prefetcher

    segs = [Segment(20, 99, 20, 1, 24, 8), Segment(100, 180, 20, 1, 24, 8, rounds_before=3)]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)   # noqa: E731
    mb = TensorDict({"input_ids": nested([torch.arange(190), torch.arange(60)]),
                     "prompts": nested([torch.arange(20)] * 2)}, batch_size=[2])
    mb["extra_fields"] = [_fields(segs, preemptions=1), _fields(None)]
    work = replayed_samples(mb, **SHAPE)
    assert [k[0] for k, _ in work[:2]] == ["segment", "segment"] and len(work) == 3
    want, _ = micro_batch_deaths(mb, 190, packed=False, store=DeathStore(0), **SHAPE)
    pool = Prefetcher(DeathStore(64 << 20), workers=1)
    try:
        pool.prefetch(work)
        got, _ = micro_batch_deaths(mb, 190, packed=False, store=pool, **SHAPE)
        t0 = time.monotonic()
        while pool._running and time.monotonic() - t0 < 60:     # a worker's done-callback may still be running
            time.sleep(0.01)
    finally:
        pool.shutdown()
    assert torch.equal(got, want) and got.shape[0] == 3
    assert pool.prefetched + pool.inline == 3 and pool.store.derived == 3


def test_the_workers_derivations_equal_the_dense_deaths_encoded():
    """What the background workers store (`derive_encoded`, `derive_segment_encoded`: derived in the compact form)
    decodes to the dense deaths the learner would otherwise build, for a one-cache sample and a rebuilt segment."""
    from kvtier.deathtime.store import decode
    from kvtier.rollout.replay_batch import derive_encoded, derive_segment_encoded

    stored = decode(*derive_encoded(_fields(), 20, 200, SHAPE["num_layers"], SHAPE["num_kv_heads"]))
    assert torch.equal(stored, sample_deaths(_fields(), 20, 200, **SHAPE))
    seg = Segment(start=100, end=180, prompt_len=20, rounds_before=3, **RANDOM)
    stored = decode(*derive_segment_encoded(seg, SHAPE["num_layers"], SHAPE["num_kv_heads"]))
    assert torch.equal(stored, segment_deaths(seg, seg.end, **SHAPE))
    assert int((stored < NEVER).sum()) > 0                      # the segment evicted: the comparison is not vacuous


def test_a_device_expands_the_compact_deaths_as_the_host_does():
    """Off the CPU the learner's device gathers the stored round index (uint8, or uint16 past 255 rounds) into
    death times; forced here on the CPU, it equals numpy's gather."""
    import numpy as np

    from kvtier.rollout.replay_batch import expand

    table = np.asarray([NEVER, 5, 9, 40], dtype=np.int32)
    for dtype, top in ((np.uint8, 4), (np.uint16, 4)):
        index = np.random.default_rng(0).integers(0, top, size=(3, 2, 50)).astype(dtype)
        host = expand(index, table, torch.device("cpu"))
        assert torch.equal(expand(index, table, torch.device("cpu"), on_device=True), host)
        assert host.dtype == torch.int32 and int((host == NEVER).sum()) == int((index == 0).sum())


def test_text_batches_with_verls_empty_multimodal_field_expand():
    """verl puts `multi_modal_inputs` (an empty dict per sample) and a False `distillation_use_topk` into text-only
    micro-batches: they expand; real multimodal inputs are refused by name."""
    from tensordict import NonTensorData, NonTensorStack

    from kvtier.rollout.replay_segments import ExpansionError, Row, expand_micro_batch

    ids = torch.nested.nested_tensor([torch.arange(6), torch.arange(4)], layout=torch.jagged)
    mb = TensorDict({"input_ids": ids, "position_ids": ids.clone()}, batch_size=[2])
    mb["multi_modal_inputs"] = NonTensorStack(NonTensorData({}), NonTensorData({}))
    mb["distillation_use_topk"] = NonTensorData(False)
    out = expand_micro_batch(mb, [Row(0, 3), Row(0, 6), Row(1, 4)])
    assert [t.numel() for t in out["input_ids"].unbind()] == [3, 6, 4]
    mb["multi_modal_inputs"] = NonTensorStack(NonTensorData({"pixel_values": torch.ones(1)}), NonTensorData({}))
    with pytest.raises(ExpansionError, match="multi_modal_inputs"):
        expand_micro_batch(mb, [Row(0, 6), Row(1, 4)])
