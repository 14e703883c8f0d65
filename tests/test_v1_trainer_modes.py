"""kvtier's `kvtier_<mode>` v1 trainers run verl's `<mode>` paths: verl's trainer base compares its mode with
"sync", so without the fix `kvtier_sync` built verl's async replay buffer (and single-prompt refills); and the
buffer looks for finished samples every 0.1 s, not verl's 2 s (which rounded each step's `timing_s/gen` up to
the next 2 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transfer_queue")


def _trainer(mode: str):
    import verl
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    import kvtier.rollout.trainer_hooks as hooks

    hooks.register_v1_trainers()
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    config.trainer.v1.trainer_mode = mode
    config.data.train_batch_size = 4
    cls = TRAINER_REGISTRY[mode]
    trainer = cls.__new__(cls)             # verl's __init__ up to the replay buffer: the mode, then the buffer
    trainer.config, trainer.trainer_mode = config, mode
    trainer.parameter_sync_step = config.trainer.v1.get(mode, {}).get("parameter_sync_step", 1)
    return trainer, trainer._build_replay_buffer()


def test_kvtier_sync_builds_verls_sync_replay_buffer_polling_often():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from kvtier.rollout.trainer_hooks import SAMPLE_POLL_SECONDS

    trainer, buffer = _trainer("kvtier_sync")
    assert type(buffer) is ReplayBuffer and trainer.trainer_mode == "sync"
    assert buffer.train_batch_size == 4 and buffer.gen_batch_size == 4     # whole-batch dispatch, as verl's sync
    assert buffer.poll_interval == SAMPLE_POLL_SECONDS == 0.1
    plain, plain_buffer = _trainer("sync")                                  # verl's own, for comparison
    assert type(plain_buffer) is ReplayBuffer and plain_buffer.poll_interval > SAMPLE_POLL_SECONDS


def test_kvtier_async_modes_stay_async():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    trainer, buffer = _trainer("kvtier_colocate_async")
    assert isinstance(buffer, ReplayBufferAsync) and trainer.trainer_mode == "colocate_async"
    # the mode's own settings apply (verl's separate_async syncs parameters every 4 steps; kvtier_separate_async
    # has no config section of its own)
    trainer, buffer = _trainer("kvtier_separate_async")
    plain, _ = _trainer("separate_async")
    assert trainer.parameter_sync_step == plain.parameter_sync_step == 4
