"""The full-attention anchors of learner replay (issue #38 item 3), without the trainer: the reference policy
at full attention (`model_type=kvtier_replay_full_ref`: its forwards carry no death times, the actor's do) and
the share of each GRPO group generated at full attention (`rollout.custom.kvtier.full_share`), and how
`kvtier rl smoke` / `kvtier bench rl` pass both to verl. The trainer-level check (the KL loss is ~0 on the
first step with a replayed reference and not with a full-attention one) rides on tests/test_rl_trainer.py's
runs."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from kvtier.deathtime import ATTN_NAME
from kvtier.deathtime.attention import DEATHS_KWARG
from kvtier.engine.config import EvictionConfigError
from kvtier.rollout.learner_replay import (FULL_REF_MODEL_TYPE, MODEL_TYPE, ReplayConfigError, check_learner_config,
                                           replay_engine_class)
from kvtier.rollout.settings import KVTierRolloutSettings

REPLAYED = {"kvtier_budget": 24, "kvtier_seed": 9, "kvtier_buffer": 8, "kvtier_policy": "random",
            "kvtier_policy_params": None, "kvtier_preemptions": 0, "kvtier_generate_calls": 1}


class _FakeFSDPEngine:
    """The slice of verl's FSDPEngineWithLMHead the replay engine overrides."""

    def __init__(self, model_config, engine_config):
        self.model_config, self.engine_config = model_config, engine_config
        self.adapter_off = False

    def prepare_model_inputs(self, micro_batch):
        return {"input_ids": torch.zeros(micro_batch.batch_size[0], 150, dtype=torch.long),
                "attention_mask": torch.ones(micro_batch.batch_size[0], 150)}, {}

    @contextmanager
    def _adapter_off(self):
        self.adapter_off = True
        yield
        self.adapter_off = False

    def disable_adapter(self):
        return self._adapter_off()

    def forward_step(self, micro_batch, loss_function, forward_only):
        self.prepare_model_inputs(micro_batch)
        return torch.tensor(0.0), {"metrics": {}}


def _engine(model_type: str, forward_only: bool):
    cls = replay_engine_class(_FakeFSDPEngine)
    model_config = SimpleNamespace(model_type=model_type, override_config={"attn_implementation": ATTN_NAME},
                                   hf_config=SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2))
    return cls(model_config, SimpleNamespace(ulysses_sequence_parallel_size=1, forward_only=forward_only))


def _micro_batch() -> TensorDict:
    td = TensorDict({"input_ids": torch.nested.nested_tensor([torch.arange(150)], layout=torch.jagged),
                     "prompts": torch.nested.nested_tensor([torch.arange(20)], layout=torch.jagged)}, batch_size=[1])
    td["extra_fields"] = [REPLAYED]
    return td


@pytest.mark.parametrize("model_type, forward_only, adapter_off, replays", [
    (MODEL_TYPE, False, False, True),              # the actor
    (MODEL_TYPE, True, False, True),               # kvtier_replay's reference: replayed like the actor
    (FULL_REF_MODEL_TYPE, False, False, True),     # the actor under kvtier_replay_full_ref still replays
    (FULL_REF_MODEL_TYPE, True, False, False),     # its separate reference engine scores at full attention
    (FULL_REF_MODEL_TYPE, False, True, False),     # LoRA: the reference is the actor with its adapter off
    (MODEL_TYPE, False, True, True),
])
def test_reference_at_full_attention_only_under_the_full_ref_model_type(model_type, forward_only, adapter_off,
                                                                       replays):
    engine = _engine(model_type, forward_only)
    assert engine.model_config.model_type == "language_model"     # verl builds the module by the base name
    if adapter_off:
        with engine.disable_adapter():
            assert engine.adapter_off
            inputs, _ = engine.prepare_model_inputs(_micro_batch())
        assert not engine.adapter_off and not engine.scores_at_full_attention()
    else:
        inputs, _ = engine.prepare_model_inputs(_micro_batch())
    assert (DEATHS_KWARG in inputs) == replays
    if replays:
        assert tuple(inputs[DEATHS_KWARG].shape) == (1, 4, 2, 150)
    _, out = engine.forward_step(_micro_batch(), None, True)
    # the learner's replay shares describe the actor's forwards, never the full-attention reference's
    assert ("actor/kvtier_replay/replayed_share" in out["metrics"]) == (replays or adapter_off)


def test_both_replay_model_types_need_learner_replay():
    check_learner_config("replay", FULL_REF_MODEL_TYPE)
    with pytest.raises(ReplayConfigError, match=FULL_REF_MODEL_TYPE):
        check_learner_config("replay", "language_model")
    with pytest.raises(ReplayConfigError, match="learner=dense"):
        check_learner_config("dense", FULL_REF_MODEL_TYPE)


def test_full_share_parses_and_refuses_a_share_that_leaves_one_kind_empty():
    s = KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "full_share": 0.25}})
    assert s.full_share == 0.25
    assert [s.full_attention_samples(n) for n in (4, 8, 16)] == [1, 2, 4]
    assert KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64}}).full_attention_samples(4) == 0
    # full attention already (no budget): nothing to anchor
    assert KVTierRolloutSettings.from_custom({"kvtier": {"budget": None, "full_share": 0.5}}).full_attention_samples(4) == 0
    for n in (1, 2):                                       # 0.25 of 1 or 2 rounds to none
        with pytest.raises(EvictionConfigError, match="full_share=0.25 with rollout.n"):
            s.full_attention_samples(n)
    for bad in (1.0, -0.1, "half", True):
        with pytest.raises(EvictionConfigError, match="custom.kvtier.full_share"):
            KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "full_share": bad}})


class _RecordingWorker:
    """verl's agent-loop worker as the mixin sees it: `_run_agent_loop` gets each trajectory's params."""

    def __init__(self, share: float, n: int):
        from omegaconf import OmegaConf

        self.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
            "name": "kvtier", "n": n, "custom": {"kvtier": {"budget": 64, "full_share": share}}}}})
        self.seen = []

    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        self.seen.append(sampling_params.get("kvtier_budget"))

    async def _agent_loop_postprocess(self, output, *args, **kwargs):
        return output


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_the_first_samples_of_each_group_run_at_full_attention(trainer):
    """verl's v0 workers number a group's samples by trajectory["rollout_n"], its v1 (TransferQueue) workers
    pass `session_id`; validation keeps `val_budget` whatever the share."""
    from kvtier.rollout.trainer_hooks import _KVTierWorker

    class Worker(_KVTierWorker, _RecordingWorker):
        pass

    worker = Worker(0.25, 4)

    async def run():
        for group in range(2):
            for i in range(4):
                if trainer == "v0":
                    await worker._run_agent_loop({}, {"rollout_n": i, "validate": False}, agent_name="single_turn")
                else:
                    await worker._run_agent_loop({}, {"rollout_n": 0, "validate": False}, session_id=i,
                                                 agent_name="single_turn")
        await worker._run_agent_loop({}, {"rollout_n": 0, "validate": True}, session_id=0, agent_name="single_turn")

    asyncio.run(run())
    assert worker.seen == ["full", None, None, None] * 2 + ["full"]   # validation: val_budget full


def test_smoke_overrides_pass_the_anchors_to_verl(tmp_path: Path):
    from kvtier.rollout.cpu.rl_smoke import check_ref_attention, overrides

    common = dict(model="m", train=tmp_path / "t", val=tmp_path / "v", workdir=tmp_path, steps=1, batch_size=2, n=4,
                  prompt_length=64, response_length=64, budget=64, buffer=16, kv_cache_mb=8, lr=1e-5, env_vars={})
    plain = overrides(**common, learner="replay")
    assert f"+actor_rollout_ref.model.model_type={MODEL_TYPE}" in plain
    assert "actor_rollout_ref.rollout.custom.kvtier.full_share=0.0" in plain
    assert not any("kl_loss_coef" in o for o in plain)
    anchored = overrides(**common, learner="replay", ref_attention="full", full_share=0.25, kl_coef=0.05)
    assert f"+actor_rollout_ref.model.model_type={FULL_REF_MODEL_TYPE}" in anchored
    assert "actor_rollout_ref.rollout.custom.kvtier.full_share=0.25" in anchored
    assert "actor_rollout_ref.actor.kl_loss_coef=0.05" in anchored
    with pytest.raises(ValueError, match="needs learner=replay"):
        check_ref_attention("full", "dense")
    with pytest.raises(ValueError, match="ref_attention must be one of"):
        check_ref_attention("dense", "replay")


@pytest.mark.parametrize("args, option, says", [
    (["--full-share", "1.5"], "--full-share", "custom.kvtier.full_share"),        # the replica's own rule
    (["--ref-attention", "full"], "--ref-attention", "needs learner=replay"),
    (["--rollout", "vllm", "--learner", "replay"], "--rollout", "rollout=vllm"),
])
def test_smoke_cli_refuses_bad_anchor_settings_before_verl_starts(args, option, says, tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["rl", "smoke", "--workdir", str(tmp_path / "w"), *args])
    out = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and option in out and says in out, out
    assert not (tmp_path / "w").exists()
