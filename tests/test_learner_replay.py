"""Learner replay (kvtier.rollout.learner_replay) without the trainer: which samples are replayed, the death
tensor of a verl micro-batch (padded and packed), a packed forward equal to each sample alone, the settings
that must agree, and the learner-vs-sampler tail metrics. The 2-step GRPO run with replay is in
tests/test_rl_trainer.py."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from kvtier.deathtime import ATTN_NAME, NEVER, register, simulate_deaths
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.rollout.learner_replay import (MODEL_TYPE, ReplayConfigError, check_engine_config, check_learner_config,
                                           micro_batch_deaths, replay_status, sample_deaths)
from kvtier.rollout.metrics import eviction_metrics_from_fields, mismatch_metrics

pytestmark = pytest.mark.usefixtures("single_torch_thread")
PPO_KL_BOUND = 1e-3        # tests/test_rl_trainer.py's bound on the replay update's |ppo_kl|

REPLAYED = {"kvtier_budget": 24, "kvtier_seed": 9, "kvtier_buffer": 8, "kvtier_policy": "random",
            "kvtier_policy_params": None, "kvtier_preemptions": 0, "kvtier_generate_calls": 1}


@pytest.mark.parametrize("change, status", [
    ({}, "replayed"),
    ({"kvtier_budget": None}, "full"),
    ({"kvtier_preemptions": 1}, "rebuilt"),
    ({"kvtier_generate_calls": 2}, "multi_call"),
    ({"kvtier_policy": "snapkv"}, "policy"),
    ({"kvtier_generate_calls": None}, "no_record"),      # not kvtier's agent-loop manager: calls unknown
    ({"kvtier_seed": None}, "no_record"),
])
def test_replay_status(change, status):
    assert replay_status({**REPLAYED, **change}) == status


def test_policy_params_rebuild_the_engines_policy():
    """protect_prefix travels in kvtier_policy_params: the re-derived record protects only that prefix."""
    whole = sample_deaths(REPLAYED, 20, 150, 4, 2)
    prefix = sample_deaths({**REPLAYED, "kvtier_policy_params": '{"protect_prefix": 4}'}, 20, 150, 4, 2)
    assert torch.equal(whole, simulate_deaths(make_policy("random"), EvictionSchedule(24, 8), 20, 150,
                                              num_layers=4, num_kv_heads=2, seed=9))
    assert (whole[..., :20] == NEVER).all() and (prefix[..., :4] == NEVER).all()
    assert (prefix[..., 4:20] != NEVER).any()


def _micro_batch(samples: list[tuple[int, int]], fields: list[dict], *, v1: bool) -> TensorDict:
    """verl's no-padding micro-batch: nested input_ids; left-padded prompt / right-padded response masks."""
    P, R = max(p for p, _ in samples), max(r for _, r in samples)
    attn = torch.zeros(len(samples), P + R, dtype=torch.long)
    resp = torch.zeros(len(samples), R, dtype=torch.long)
    for b, (p, r) in enumerate(samples):
        attn[b, P - p : P + r] = 1
        resp[b, :r] = 1
    ids = torch.nested.nested_tensor([torch.arange(10, 10 + p + r) for p, r in samples], layout=torch.jagged)
    td = TensorDict({"input_ids": ids}, batch_size=[len(samples)])
    if v1:   # verl's v1 trainer: nested prompts, one extra_fields dict per sample (a NonTensorStack)
        td["prompts"] = torch.nested.nested_tensor([torch.arange(p) for p, _ in samples], layout=torch.jagged)
        td["extra_fields"] = fields
    else:    # v0: left-right padded masks, one column per key
        td["attention_mask"], td["response_mask"] = attn, resp
        for key in REPLAYED:
            td[key] = [f.get(key) for f in fields]
    return td


@pytest.mark.parametrize("v1", [True, False])
def test_micro_batch_deaths_padded_and_packed(v1):
    samples = [(20, 130), (12, 60), (16, 40)]
    fields = [REPLAYED, {**REPLAYED, "kvtier_budget": None}, {**REPLAYED, "kvtier_seed": 3}]
    mb = _micro_batch(samples, fields, v1=v1)
    own = [sample_deaths(f, p, p + r, 4, 2) for f, (p, r) in zip(fields, samples)]
    assert own[1] is None
    padded, counts = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2)
    assert counts == {"replayed": 2, "full": 1, "rebuilt": 0, "multi_call": 0, "policy": 0, "no_record": 0}
    assert padded.shape == (3, 4, 2, 150)
    assert torch.equal(padded[0], own[0]) and (padded[1] == NEVER).all()
    assert torch.equal(padded[2, ..., :56], own[2]) and (padded[2, ..., 56:] == NEVER).all()
    packed, _ = micro_batch_deaths(mb, 150 + 72 + 56 + 5, packed=True, num_layers=4, num_kv_heads=2)
    assert packed.shape == (1, 4, 2, 283)
    # sample 0 at 0..149, sample 1 at 150..221, sample 2 at 222..277; every key dies at its segment's end
    assert torch.equal(packed[0, ..., :150], own[0].clamp(max=150))
    assert (packed[0, ..., 150:222] == 222).all()
    d2 = own[2]
    assert torch.equal(packed[0, ..., 222:278], torch.where(d2 == NEVER, torch.tensor(278), d2 + 222).to(torch.int32))
    assert (packed[0, ..., 278:] == NEVER).all()             # verl's static pad at the end


def test_no_replayed_sample_gives_no_deaths():
    mb = _micro_batch([(10, 20)], [{**REPLAYED, "kvtier_budget": None}], v1=True)
    deaths, counts = micro_batch_deaths(mb, 30, packed=False, num_layers=4, num_kv_heads=2)
    assert deaths is None and counts["full"] == 1


def test_packed_forward_equals_each_sample_alone(tiny_model_dir):
    """One packed row (use_remove_padding=true: no attention mask, positions restart per sample) under the
    micro-batch's deaths gives each sample's logits of its own forward under its own deaths."""
    from transformers import AutoModelForCausalLM

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    samples = [(20, 130), (12, 60)]
    fields = [REPLAYED, {**REPLAYED, "kvtier_seed": 4}]
    mb = _micro_batch(samples, fields, v1=True)
    ids = mb["input_ids"].values().unsqueeze(0)
    pos = torch.cat([torch.arange(p + r) for p, r in samples]).unsqueeze(0)
    deaths, _ = micro_batch_deaths(mb, ids.shape[-1], packed=True, num_layers=4, num_kv_heads=2)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, kvtier_deaths=deaths).logits[0]
        start = 0
        for f, (p, r) in zip(fields, samples):
            alone_ids = ids[:, start : start + p + r]
            alone = model(input_ids=alone_ids, kvtier_deaths=sample_deaths(f, p, p + r, 4, 2).unsqueeze(0)).logits[0]
            assert torch.allclose(packed[start : start + p + r], alone, atol=1e-4)
            dense = model(input_ids=alone_ids).logits[0]
            assert (dense - alone).abs().max() > 0.1          # the eviction changed attention: the check has power
            start += p + r


def test_learner_and_engine_settings_must_agree():
    check_learner_config("replay", MODEL_TYPE)
    check_learner_config("dense", "language_model")
    with pytest.raises(ReplayConfigError, match="model_type"):
        check_learner_config("replay", "language_model")
    with pytest.raises(ReplayConfigError, match="learner=dense"):
        check_learner_config("dense", MODEL_TYPE)
    from types import SimpleNamespace

    with pytest.raises(ReplayConfigError, match="override_config.attn_implementation=kvtier_deathtime"):
        check_engine_config(SimpleNamespace(override_config={"attn_implementation": "sdpa"}),
                            SimpleNamespace(ulysses_sequence_parallel_size=1))
    with pytest.raises(ReplayConfigError, match="ulysses_sequence_parallel_size"):
        check_engine_config(SimpleNamespace(override_config={"attn_implementation": ATTN_NAME}),
                            SimpleNamespace(ulysses_sequence_parallel_size=2))


def test_rollout_settings_parse_learner():
    from kvtier.engine.config import EvictionConfigError
    from kvtier.rollout.settings import KVTierRolloutSettings

    assert KVTierRolloutSettings.from_custom({"kvtier": {"learner": "replay"}}).learner == "replay"
    assert KVTierRolloutSettings.from_custom({"kvtier": {}}).learner == "dense"
    with pytest.raises(EvictionConfigError, match="custom.kvtier.learner"):
        KVTierRolloutSettings.from_custom({"kvtier": {"learner": "exact"}})


def test_mismatch_metrics_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.4, 0.9]]))
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    m = mismatch_metrics(old, rollout, mask, prefix="m")
    ratios = torch.tensor([1.0, 2.0, 0.8])                    # the masked token (ratio 9) is left out
    assert m["m/token_ratio_min"] == pytest.approx(0.8)
    assert m["m/share_below_0_86"] == pytest.approx(1 / 3)
    assert m["m/max_abs_log_ratio"] == pytest.approx(float(torch.log(torch.tensor(2.0))))
    assert m["m/kl"] == pytest.approx(float((ratios - 1 - ratios.log()).mean()), rel=1e-5)
    assert m["m/token_ratio_p01"] == pytest.approx(float(torch.quantile(ratios, 0.01)))
    assert m["m/token_ratio_p05"] == pytest.approx(float(torch.quantile(ratios, 0.05)))


def test_sequence_k3_tails_are_verls_seq_mean_k3():
    """The per-sample mean k3 tails (what a dense-rs threshold is chosen from) are the statistic verl's
    rollout_rs=seq_mean_k3 rejects on: a threshold between two samples' values rejects the larger one."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    old = torch.log(torch.tensor([[0.5, 0.5, 0.4, 0.9], [0.9, 0.9, 0.9, 0.9], [0.2, 0.6, 0.6, 0.6]]))
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.1], [0.9, 0.8, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]]))
    old[1, 3] = 22.0                  # a log ratio past verl's clamp (+-20): both clamp it the same way
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    m = mismatch_metrics(old, rollout, mask, prefix="m")
    lr = (old - rollout).masked_fill(mask == 0, 0.0).clamp(-20, 20)
    per = ((lr.exp() - 1 - lr).sum(-1) / mask.sum(-1)).tolist()
    assert m["m/seq_k3_max"] == pytest.approx(max(per))
    assert m["m/seq_k3_p50"] == pytest.approx(sorted(per)[1])
    threshold = (sorted(per)[1] + sorted(per)[2]) / 2
    keep, _ = compute_rollout_rejection_mask(log_ratio=old - rollout, response_mask=mask.float(),
                                             rollout_rs="seq_mean_k3", rollout_rs_threshold=threshold)
    kept = keep.sum(-1) > 0
    assert kept.tolist() == [v <= threshold for v in per]


def test_groups_with_signal_from_the_v1_transfer_queue():
    """#38 item 1: how many GRPO groups had rewards that differ, read as the kvtier_<mode> trainers read the
    step's samples (padding left out; rm_scores are token-level, nested)."""
    from types import SimpleNamespace

    from kvtier.rollout.trainer_hooks import v1_eviction_metrics

    uids = ["a", "a", "b", "b", "c", "c", "c"]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]           # the last "c" is padding: group c has no signal
    scores = torch.nested.nested_tensor([torch.tensor([0.0] * 3 + [r]) for r in rewards], layout=torch.jagged)
    store = {"extra_fields": [{} for _ in uids], "uid": uids, "rm_scores": scores}
    meta = SimpleNamespace(keys=[str(i) for i in range(7)], partition_id="train",
                           tags=[{}] * 6 + [{"is_padding": True}])
    got = v1_eviction_metrics(meta, kv_batch_get=lambda keys, partition_id, select_fields: {
        k: store[k] for k in select_fields})
    assert got["rollout/kvtier/grpo/groups"] == 3.0 and got["rollout/kvtier/grpo/groups_with_signal"] == 1.0


def test_p05_and_share_below_0_86_read_one_criterion():
    """Sparrow's criterion two ways: p05 >= 0.86 when at most 5% of the tokens are below 0.86 (away from the
    boundary, where the quantile's interpolation decides)."""
    for below in (0, 3, 4, 7, 40):     # of 100 tokens
        ratios = torch.cat([torch.full((below,), 0.5), torch.full((100 - below,), 1.0)])
        m = mismatch_metrics(ratios.log().unsqueeze(0), torch.zeros(1, 100), torch.ones(1, 100), prefix="m")
        assert (m["m/token_ratio_p05"] >= 0.86) == (m["m/share_below_0_86"] <= 0.05), below


def test_eviction_metrics_count_replay_statuses():
    rows = [REPLAYED, {**REPLAYED, "kvtier_preemptions": 2}, {**REPLAYED, "kvtier_budget": None}]
    m = eviction_metrics_from_fields(rows)
    assert (m["rollout/kvtier/replayable/replayed"], m["rollout/kvtier/replayable/rebuilt"],
            m["rollout/kvtier/replayable/full"]) == (1, 1, 1)


def test_smoke_step_record_reads_the_learner_entries_of_both_trainers():
    """`kvtier rl smoke`'s per-step record: the mismatch and replayable entries under each trainer's prefix
    (v1: rollout/kvtier/..., v0: timing_s/rollout/kvtier/...), and nothing from the other's; the learner's own
    replay shares (verl's actor metrics, either trainer) apart from the rollout's records."""
    from kvtier.rollout.cpu.rl_smoke_records import step_record

    data = {"timing_s/rollout/kvtier/replayable/replayed": 8.0, "timing_s/rollout/kvtier/mismatch/kl": 1e-5,
            "rollout/kvtier/replayable/full": 3.0, "rollout/kvtier/mismatch/token_ratio_p01": 0.5,
            "actor/kvtier_replay/replayed_share": 1.0, "actor/kvtier_replay/full_share": 0.0}
    v0, v1 = step_record(1, data, [], 8, "v0"), step_record(1, data, [], 8, "v1")
    assert (v0["rollout_replayable"], v0["learner_vs_rollout"]) == ({"replayed": 8}, {"kl": 1e-5})
    assert (v1["rollout_replayable"], v1["learner_vs_rollout"]) == ({"full": 3}, {"token_ratio_p01": 0.5})
    assert v0["learner_replay_share"] == v1["learner_replay_share"] == {"replayed": 1.0, "full": 0.0}


def test_learner_shares_are_verl_mean_metrics_of_one_forward():
    from kvtier.rollout.learner_replay import learner_shares

    shares = learner_shares({"replayed": 3, "full": 1, "rebuilt": 0, "multi_call": 0, "policy": 0, "no_record": 0})
    assert shares["actor/kvtier_replay/replayed_share"].aggregate() == 0.75
    assert shares["actor/kvtier_replay/full_share"].aggregation.value == "mean"


def test_replica_checks_the_learner_against_the_actors_model_only():
    """The actor's rollout replica refuses learner=replay without model_type=kvtier_replay; a reward-model or
    teacher replica (its own model config, never trained here) does not."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from kvtier.rollout.replica import KVTierReplica

    cfg = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "kvtier",
                            "custom": {"kvtier": {"learner": "replay", "budget": 64}}})
    plain = SimpleNamespace(model_type="language_model")
    for role in ({"is_reward_model": True}, {"is_teacher_model": True}):
        assert KVTierReplica(0, cfg, plain, gpus_per_node=1, **role).settings.learner == "replay"
    with pytest.raises(ReplayConfigError, match="model_type"):
        KVTierReplica(0, cfg, plain, gpus_per_node=1)
    assert KVTierReplica(0, cfg, SimpleNamespace(model_type=MODEL_TYPE), gpus_per_node=1).settings.learner == "replay"


def test_micro_batch_deaths_are_built_on_the_given_device_and_not_kept():
    """Each forward re-derives its micro-batch's deaths (no dense per-sample cache) on the learner's device."""
    mb = _micro_batch([(20, 130)], [REPLAYED], v1=True)
    first, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2, device="meta")
    assert first.device.type == "meta" and tuple(first.shape) == (1, 4, 2, 150)
    a, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2)
    b, _ = micro_batch_deaths(mb, 150, packed=False, num_layers=4, num_kv_heads=2)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert not hasattr(sample_deaths, "cache_info")


def test_replay_memory_bench_measures_host_and_device_bytes_per_rank():
    """`kvtier bench replay-memory` at a small shape: the device holds one micro-batch's tensor, the host
    stays under the 1 GiB limit, and the old cache's bytes for the batch are reported beside it."""
    from kvtier.benchmarks.replay_memory import HOST_LIMIT_BYTES, run_replay_memory_bench

    r = run_replay_memory_bench(layers=4, kv_heads=2, tokens=4096, prompt=64, budget=512, buffer=64, batch=64,
                                ranks=2, micro_batch=2)
    assert r["bytes_per_sample"] == 4 * 2 * 4096 * 4
    assert r["device_bytes_per_rank"] == 2 * r["bytes_per_sample"]
    assert 0 <= r["host_bytes_per_rank"] < HOST_LIMIT_BYTES and r["within_host_limit"]
    assert r["host_bytes_per_rank_cached_before"] == 32 * r["bytes_per_sample"]
    assert r["seconds_per_sample"] > 0
    # a learner on an accelerator: the host hands over the stored arrays, the device expands them
    assert 0 < r["served_host_cpu_seconds_per_sample_device_learner"] < r["served_seconds_per_sample"] + 0.01
    assert r["host_cpu_seconds_per_sample_per_step_device_learner"] >= r["derivation_cpu_seconds"]
    cp = r["critical_path"]                  # with the background workers: every sample derived once (+ a warm-up)
    assert cp["prefetched"] + cp["derived_by_forwards"] == cp["settings"]["samples"] + 1


def test_a_dense_update_would_break_the_ppo_kl_bound():
    """The negative control of tests/test_rl_trainer.py's replay ppo_kl check (#38 item 1, |ppo_kl| <
    PPO_KL_BOUND there): were update_actor's forward dense while the old log-probs were replayed, ppo_kl (verl:
    the token mean of old - new log-probs) would read the replayed-minus-dense difference. On the shipped
    reasoner's gold traces at that run's K = 512 it is -2.1e-3 (4 local chains), twice the bound; on sampled
    traces the dense learner's mismatch is larger (the dense arms' learner-vs-rollout KL per step, 0.007-0.026
    in results/rl-cpu-2026-12-04.json)."""
    from transformers import AutoModelForCausalLM

    from kvtier.models.reasoner import build_reasoner_tokenizer, reasoner_dir
    from kvtier.tasks import chains

    register()
    model = AutoModelForCausalLM.from_pretrained(str(reasoner_dir()), dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    tok = build_reasoner_tokenizer()
    diff, tokens = 0.0, 0
    for i, p in enumerate(chains.eval_problems(4, "local")):
        prompt = tok(p.prompt)["input_ids"]
        ids = torch.tensor([prompt + tok(p.trace, add_special_tokens=False)["input_ids"]])
        deaths = simulate_deaths(make_policy("random"), EvictionSchedule(budget=512, buffer=32), len(prompt),
                                 ids.shape[1], num_layers=model.config.num_hidden_layers,
                                 num_kv_heads=model.config.num_key_value_heads, seed=i)
        target = ids[0, len(prompt):]
        with torch.no_grad():
            def logp(**kw):
                out = torch.log_softmax(model(input_ids=ids, **kw).logits[0, len(prompt) - 1:-1].float(), -1)
                return out.gather(1, target[:, None])[:, 0]
            replayed, dense = logp(kvtier_deaths=deaths.unsqueeze(0)), logp()
        diff += float((replayed - dense).sum())
        tokens += len(target)
    assert abs(diff / tokens) > PPO_KL_BOUND, diff / tokens
