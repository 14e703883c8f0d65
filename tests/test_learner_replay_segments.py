"""Learner replay by segment on the vLLM engine's samples (issue #60 item 3): a sample generated on several caches
carries its segments from the engine to the learner (`kvtier_segments`: the engine's reset rows and rounds
before each, every call's own prompt, seed and parameters; built by the rollout server's `segments_record` from
the engine's per-request counters and joined by the client's `SampleCounters`), is counted `replayed`, and the
learner (kvtier's subclass of verl's FSDP engine: its `prepare_model_inputs` / `prepare_model_outputs` around the
model's forward, padded and packed) gives every sampled token the log-prob of the masked reference's forward per
segment (`kvtier.reference.replay`, under the engine's logged keep-sets). One test per case: preempted and
rebuilt, several calls (a tool turn), a resumed partial rollout. The record and the row plan alone:
tests/test_replay_segments.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from kvtier.deathtime.segments import Segment
from kvtier.rollout.replay_status import by_segment, replay_status
from kvtier.rollout.sample_counters import SampleCounters

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_torch_thread")]
BUDGET, BUFFER = 100, 16
TOL = 1e-3              # the learner's fp32 forward vs the fp32 masked reference's (same weights)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """The tiny model in an 11-block pool (stock admission preempts concurrent compressed requests), with the
    keep-set audit log the masked reference replays."""
    pytest.importorskip("vllm")
    from kvtier.engine.api import build_llm

    audit = str(tmp_path_factory.mktemp("segments_audit") / "keep.jsonl")
    llm = build_llm(tiny_model_dir, eviction={"default": {"policy": "random", "buffer": BUFFER}, "admission": "vllm",
                                              "audit_log": audit},
                    kv_cache_bytes=3 << 20, max_model_len=1024, max_num_seqs=16, enforce_eager=True)
    yield SimpleNamespace(llm=llm, audit=audit)
    del llm


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    """kvtier's replay engine over verl's `FSDPEngineWithLMHead`, without FSDP's set-up: the attributes verl's
    `prepare_model_inputs` / `prepare_model_outputs` read, the tiny model in fp32 as its module."""
    from transformers import AutoModelForCausalLM
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from kvtier.deathtime import ATTN_NAME, register
    from kvtier.rollout.learner_replay import replay_engine_class

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTN_NAME)
    eng = object.__new__(replay_engine_class(FSDPEngineWithLMHead))
    eng.__dict__.update(model_config=SimpleNamespace(hf_config=model.config), module=model.eval(),
                        engine_config=SimpleNamespace(entropy_checkpointing=False,
                                                      entropy_from_logits_with_chunking=False),
                        pad_to_length=False, use_ulysses_sp=False, ulysses_sequence_parallel_size=1,
                        compute_entropy_from_logits=verl_F.entropy_from_logits, _full_ref=False,
                        _reference_engine=False, _adapter_disabled=False, _replay_logged=False, _replay_counts=None,
                        _expansion=None)
    return eng


def _call(engine, prompt_ids, max_tokens, seed, **kvtier):
    """One greedy generate call per prompt; each output with the per-call fields the rollout server returns."""
    return _calls(engine, [prompt_ids], max_tokens, [seed], **kvtier)[0]


def _calls(engine, prompts, max_tokens, seeds, **kvtier):
    from engine_helpers import greedy, records_for

    from kvtier.engine.config import EvictionSpec, resolve_request_spec
    from kvtier.rollout.request_stats import sample_fields

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(seeds)
    params = [greedy(m, budget=BUDGET, seed=s, **kvtier) for m, s in zip(lengths, seeds)]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = engine.llm.collective_rpc("kvtier_request_stats", args=([o.request_id for o in outs],))[0]
    done = []
    for out, p in zip(outs, params):
        spec = resolve_request_spec(EvictionSpec(policy="random", buffer=BUFFER), p.extra_args)
        counters, generated = stats[out.request_id], list(out.outputs[0].token_ids)
        extra = sample_fields(spec, None, len(out.prompt_token_ids), len(generated), counters, out.request_id)
        done.append(SimpleNamespace(prompt=list(out.prompt_token_ids), generated=generated, extra=extra,
                                    records=records_for(engine.audit, out.request_id)))
    return done


def _sample(calls, ids, prompt_len, records, scored):
    """A sample made of `calls` (the client adds them up: `SampleCounters`), its tokens, the reference's records
    and the token positions the calls sampled."""
    counters = SampleCounters()
    for c in calls:
        counters.add(c.extra)
    return SimpleNamespace(ids=ids, prompt_len=prompt_len, fields=counters.totals(), records=records, scored=scored)


def _learner_logprobs(learner, samples, packed, grad=False):
    """verl's forward of one micro-batch (v1's no-padding TensorDict) with the replay engine: its log-prob rows
    (row i scores token i + 1) per sample, and the forward's counts."""
    from verl.utils import tensordict_utils as tu

    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)   # noqa: E731
    mb = TensorDict({"input_ids": nested([torch.tensor(s.ids) for s in samples]),
                     "position_ids": nested([torch.arange(len(s.ids)) for s in samples]),
                     "prompts": nested([torch.tensor(s.ids[: s.prompt_len]) for s in samples])},
                    batch_size=[len(samples)])
    mb["extra_fields"] = [s.fields for s in samples]
    tu.assign_non_tensor(mb, use_remove_padding=packed, temperature=1.0, calculate_entropy=True)
    with torch.set_grad_enabled(grad):
        inputs, args = learner.prepare_model_inputs(micro_batch=mb)
        raw = learner.module(**inputs, use_cache=False)
        out = learner.prepare_model_outputs(output=raw, output_args=args, micro_batch=mb, logits_processor_func=None)
    assert out["entropy"].offsets().tolist() == mb["input_ids"].offsets().tolist()
    return out["log_probs"].unbind(), learner._replay_counts


def _check_against_reference(learner, replay, samples, segmented):
    """Padded and packed: every sampled token's learner log-prob equals the masked reference's; the samples are
    counted replayed, `segmented` of them by segment."""
    from kvtier.rollout.learner_replay import BY_SEGMENT

    want = [replay.logprobs(s.ids, s.prompt_len, s.records, BUFFER) for s in samples]
    for packed in (False, True):
        got, counts = _learner_logprobs(learner, samples, packed)
        assert counts["replayed"] == len(samples) and counts[BY_SEGMENT] == segmented, counts
        for s, lp, ref in zip(samples, got, want):
            rows = torch.tensor(s.scored) - 1
            err = (lp[rows] - ref[rows - s.prompt_len + 1]).abs().max()
            assert err < TOL, f"packed={packed}: max |learner - masked reference| = {err:.2e}"
    return want


def _earlier_segment_rows(sample):
    """Rows of every segment but the last that ran a round (where one death tensor would be wrong)."""
    segs = [Segment(**d) for d in json.loads(sample.fields["kvtier_segments"])]
    return [i for s in segs[:-1] if s.rounds() for i in range(s.start - 1, s.end)]


def _control(replay, sample, ref):
    """Those rows under full attention (what one tensor of the last segment's deaths gives them) differ: the
    check has power."""
    rows = torch.tensor(_earlier_segment_rows(sample))
    assert len(rows), "no earlier segment evicted: the case is not exercised"
    dense = replay.logprobs(sample.ids, sample.prompt_len, [], BUFFER)
    assert (dense - ref)[rows - sample.prompt_len + 1].abs().max() > 0.05


def test_preempted_and_rebuilt_samples_are_replayed_by_segment(engine, learner, replay):
    """Six concurrent compressed requests in the 11-block pool: past K + 2r = 132 entries each needs a second
    block, so vLLM preempts one, after its rounds ran, until the shortest request finishes (a few times). Each
    sample's record comes from the engine's counters, and the learner's log-probs (and, packed, their
    gradients) equal the masked reference's forward per segment, for the rebuilt samples and two one-cache
    samples beside them in the micro-batch."""
    prompts = [[10 + (7 * i + j) % 3000 for j in range(24 + i)] for i in range(6)]
    calls = _calls(engine, prompts, [150] + [250] * 5, list(range(6)))
    samples = [_sample([c], c.prompt + c.generated, len(c.prompt), c.records,
                       list(range(len(c.prompt), len(c.prompt) + len(c.generated)))) for c in calls]
    rebuilt = [s for s in samples if s.fields["kvtier_preemptions"]]
    assert rebuilt, "no request was preempted"
    samples = rebuilt + [s for s in samples if not s.fields["kvtier_preemptions"]][:2]
    assert all(replay_status(s.fields) == "replayed" and by_segment(s.fields) for s in rebuilt)
    deep = [s for s in rebuilt if _earlier_segment_rows(s)]
    assert deep, "no request was preempted after a round: the case is not exercised"
    want = _check_against_reference(learner, replay, samples, len(rebuilt))
    _control(replay, deep[0], want[samples.index(deep[0])])
    _check_gradients(learner, replay, deep[0])


def test_a_multi_call_sample_is_replayed_by_segment(engine, learner, replay):
    """Two generate calls (a tool turn): the second call's prompt is the first prompt, its answer and a tool
    reply, with only the first prompt protected (the server's `protect: first_turn`); both calls evicted. The
    learner scores the sample with a forward per call and gives every generated token the masked reference's
    log-prob (the second call's cache rebuilt from its prompt: a reset row at its first query); beside it in
    the micro-batch, the first call alone is a plain one-cache sample."""
    prompt = [10 + (13 * j) % 3000 for j in range(30)]
    first = _call(engine, prompt, 150, seed=11)
    tool = [5, 6, 7, 8, 9]
    context = prompt + first.generated + tool
    second = _call(engine, context, 150, seed=12, protect_prefix=len(prompt))
    ids = context + second.generated
    p2 = len(context)
    records = first.records + [{"reset_row": p2 - 1}] + second.records
    scored = list(range(len(prompt), len(prompt) + 150)) + list(range(p2, len(ids)))
    sample = _sample([first, second], ids, len(prompt), records, scored)
    assert sample.fields["kvtier_generate_calls"] == 2 and by_segment(sample.fields)
    assert [json.loads(c.extra["kvtier_policy_params"] or "{}").get("protect_prefix") for c in (first, second)] == [
        None, len(prompt)]
    alone = _sample([first], prompt + first.generated, len(prompt), first.records, scored[:150])
    want = _check_against_reference(learner, replay, [sample, alone], 1)
    _control(replay, sample, want[0])


def test_a_resumed_partial_rollout_is_replayed_by_segment(engine, learner, replay):
    """verl's partial-rollout client resubmits an interrupted sample with the tokens so far appended to its
    prompt (`FullyAsyncLLMServerClient.generate`; kvtier's server aborts running requests when it sleeps): here
    the first attempt stops after 150 tokens and the second resumes from there, protecting the first prompt.
    The attempts' segments join without a gap; the learner equals the masked reference on every token."""
    prompt = [10 + (17 * j) % 3000 for j in range(28)]
    first = _call(engine, prompt, 150, seed=21)
    resumed = _call(engine, prompt + first.generated, 120, seed=22, protect_prefix=len(prompt))
    ids = prompt + first.generated + resumed.generated
    p2 = len(prompt) + len(first.generated)
    sample = _sample([first, resumed], ids, len(prompt), first.records + [{"reset_row": p2 - 1}] + resumed.records,
                     list(range(len(prompt), len(ids))))
    segs = json.loads(sample.fields["kvtier_segments"])
    assert [(s["start"], s["end"]) for s in segs] == [(len(prompt), p2 - 1), (p2, len(ids) - 1)]
    want = _check_against_reference(learner, replay, [sample], 1)
    _control(replay, sample, want[0])


def _check_gradients(learner, replay, sample):
    """The packed learner's sum of sampled-token log-probs has the gradient of the reference's forwards per
    segment (the same weights, under the logged keep-sets): every segment's row contributes."""
    from kvtier.reference.replay import segments

    model = learner.module
    params = [p for p in model.parameters() if p.requires_grad]
    rows = torch.tensor(sample.scored) - 1
    lp, _ = _learner_logprobs(learner, [sample], packed=True, grad=True)
    got = torch.autograd.grad(lp[0][rows].sum(), params)
    ids = torch.tensor([sample.ids])
    n, total = len(sample.ids), 0.0
    for first, end, recs in segments(sample.records, n):
        deaths = replay.deaths(recs, n, BUFFER).unsqueeze(0) if recs else None
        logits = model(input_ids=ids, **({} if deaths is None else {"kvtier_deaths": deaths})).logits[0]
        lps = torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        mine = rows[(rows >= first) & (rows < end)]
        total = total + lps[mine].sum()
    want = torch.autograd.grad(total, params)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-3)
    assert any(g.abs().sum() > 0 for g in got)
