"""kvtier in verl 0.9.1's trainers, through the hooks verl offers (no verl file is changed).

**Agent-loop manager** (`actor_rollout_ref.rollout.agent.agent_loop_manager_class:
kvtier.rollout.trainer_hooks.KVTierAgentLoopManager`; both trainers read this key, `RayPPOTrainer`
(`trainer.use_v1=false`) and `TaskRunnerV1`):

* validation at `rollout.custom.kvtier.val_budget` (default: full attention). verl flags validation only
  inside its agent-loop workers (`trajectory["validate"]`), not in the sampling params a server receives;
  kvtier's workers add `kvtier_budget` to the sampling params of validation trajectories.
* per-sample counters over every generate call of a sample (each turn of a multi-turn agent loop, each
  attempt of a resumed partial rollout), which verl's own merges drop (`kvtier.rollout.sample_counters`);
* `trainer.use_v1=false`: the eviction metrics of each generated batch (`metrics.eviction_metrics`) go into
  the output's `meta_info["timing"]`, which `RayPPOTrainer.fit` merges into the step's `timing_raw`; verl
  logs every entry there as `timing_s/<name>` (it does the same with its own `agent_loop/num_preempted/*`),
  so they appear as `timing_s/rollout/kvtier/eviction_events/mean`, ...
* `trainer.use_v1=true`: `create()` returns the TransferQueue variant (`AgentLoopManagerTQ` subclass), which
  `TaskRunnerV1` needs.

**v1 trainer metrics**: verl's v1 trainers keep each sample's `extra_fields` (where the kvtier server puts
its per-sample counters) in the TransferQueue and reduce none of them. `register_v1_trainers()` registers,
for every trainer mode verl has (`sync`, `colocate_async`, `separate_async`), a `kvtier_<mode>` trainer
whose `_compute_metrics` adds `eviction_metrics_from_fields` of the step's samples (logged as
`rollout/kvtier/...`); select it with `trainer.v1.trainer_mode=kvtier_sync`. The registration runs when this
module is imported and transfer_queue is installed; `kvtier.rollout.verl_plugin` (the one module a job names
in `VERL_USE_EXTERNAL_MODULES`) imports it once verl's v1 trainer package is imported, before
`TaskRunnerV1` resolves the mode.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

import kvtier.rollout.verl_plugin  # noqa: F401
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.utils.ray_utils import auto_await

from .metrics import (eviction_metrics, eviction_metrics_from_fields, group_signal_metrics, learner_entries,
                      mismatch_metrics)
from .sample_counters import apply_totals, counting, counting_client
from .settings import KVTierRolloutSettings

logger = logging.getLogger("kvtier.rollout")

TIMING_KEY = "timing"


def validation_args(config) -> dict[str, Any]:
    """kvtier_* sampling params for validation trajectories under the full trainer `config`."""
    rollout = config.actor_rollout_ref.rollout
    if getattr(rollout, "name", None) != "kvtier":
        return {}
    return KVTierRolloutSettings.from_rollout_config(rollout).validation_request_args()


def full_attention_samples(config) -> int:
    """How many of each group's training trajectories run at full attention (`full_share`, first ones)."""
    rollout = config.actor_rollout_ref.rollout
    if getattr(rollout, "name", None) != "kvtier":
        return 0
    return KVTierRolloutSettings.from_rollout_config(rollout).full_attention_samples(int(rollout.n))


class _KVTierWorker:
    """Mixin for verl's agent-loop workers (`AgentLoopWorker`, `AgentLoopWorkerTQ`); both call
    `_run_agent_loop(sampling_params, trajectory, ...)` once per trajectory, in its own asyncio task, with the
    dict they pass on to the agent loop (and from there to the server), and `_agent_loop_postprocess(output,
    ...)` inside it before the output becomes a batch row.

    * validation trajectories get `val_budget` in their sampling params; of each group of training
      trajectories, the first `round(full_share * n)` get full attention (verl's v1 workers number a group's
      samples by `session_id`, its v0 workers by `trajectory["rollout_n"]`);
    * the eviction counters of every generate call of the trajectory (each turn, each resumed attempt) are
      added up into its output's `extra_fields` (`kvtier.rollout.sample_counters`)."""

    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        if trajectory.get("validate"):
            if not hasattr(self, "_kvtier_val_args"):
                self._kvtier_val_args = validation_args(self.config)
            if self._kvtier_val_args:
                sampling_params = {**sampling_params, **self._kvtier_val_args}
        else:
            if not hasattr(self, "_kvtier_full_samples"):
                self._kvtier_full_samples = full_attention_samples(self.config)
            if int(kwargs.get("session_id", trajectory.get("rollout_n", 0)) or 0) < self._kvtier_full_samples:
                sampling_params = {**sampling_params, "kvtier_budget": "full"}
        self.llm_client = counting_client(getattr(self, "llm_client", None))
        with counting():
            return await super()._run_agent_loop(sampling_params, trajectory, *args, **kwargs)

    async def _agent_loop_postprocess(self, output, *args, **kwargs):
        apply_totals(output)
        return await super()._agent_loop_postprocess(output, *args, **kwargs)


class KVTierAgentLoopWorker(_KVTierWorker, AgentLoopWorker):
    pass


class KVTierAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager with kvtier's validation budget and eviction metrics (see the module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        if not hasattr(self, "agent_loop_workers_class"):
            self.agent_loop_workers_class = ray.remote(KVTierAgentLoopWorker)
        super().__init__(*args, **kwargs)

    @classmethod
    def create(cls, *args, **kwargs):
        """What verl's trainers call: the TransferQueue variant under `trainer.use_v1=true`."""
        config = kwargs.get("config", args[0] if args else None)
        if cls is KVTierAgentLoopManager and config is not None and _use_v1(config):
            return v1_manager_class().create(*args, **kwargs)
        return cls.create_dataproto(*args, **kwargs)

    @classmethod
    def create_dataproto(cls, *args, **kwargs):
        """The DataProto-in/DataProto-out manager whatever `trainer.use_v1` says (`RayPPOTrainer`'s path;
        `kvtier.rollout.cpu.local.LocalRollout`)."""
        return super().create(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts):
        output = await super().generate_sequences(prompts)
        add_eviction_metrics(output)
        return output


def add_eviction_metrics(output) -> dict[str, float]:
    """Put the batch's eviction metrics where `RayPPOTrainer` logs them (its `meta_info["timing"]`)."""
    metrics = eviction_metrics(output)
    if metrics:
        output.meta_info.setdefault(TIMING_KEY, {}).update(metrics)
    return metrics


def _use_v1(config) -> bool:
    trainer = config.get("trainer", {}) if hasattr(config, "get") else getattr(config, "trainer", {})
    return bool(trainer.get("use_v1", False)) if hasattr(trainer, "get") else bool(getattr(trainer, "use_v1", False))


_V1: dict[str, Any] = {}


def v1_manager_class():
    """`AgentLoopManagerTQ` with kvtier's agent-loop workers (imports transfer_queue). Built on first use;
    module attributes (`KVTierAgentLoopManagerTQ`, `KVTierAgentLoopWorkerTQ`, PEP 562 `__getattr__`); Ray
    pickles the manager by reference like the v0 classes, the worker by value (see below)."""
    if not _V1:
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

        worker_base = getattr(AgentLoopWorkerTQ, "__ray_actor_class__", AgentLoopWorkerTQ)   # it is @ray.remote

        class KVTierAgentLoopWorkerTQ(_KVTierWorker, worker_base):
            pass

        class KVTierAgentLoopManagerTQ(AgentLoopManagerTQ):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.agent_loop_workers_class = ray.remote(KVTierAgentLoopWorkerTQ)

        # Only the manager is pickled by reference. The worker must stay pickled by value, the way Ray ships
        # verl's own `AgentLoopWorkerTQ`: its inherited methods (tracing-wrapped onto Ray's actor class) are
        # pickled by value because `agent_loop_tq.AgentLoopWorkerTQ` names the ActorClass, not the class, and
        # so is the class in their zero-arg `super()` cell. By reference, the actor process would rebuild the
        # worker on its own import of verl's class while `__init__`'s cell held a by-value copy:
        # "super(type, obj): obj must be an instance or subtype of type". By value, both are one copy.
        KVTierAgentLoopManagerTQ.__qualname__ = KVTierAgentLoopManagerTQ.__name__
        for cls in (KVTierAgentLoopWorkerTQ, KVTierAgentLoopManagerTQ):
            cls.__module__ = __name__
            _V1[cls.__name__] = cls
    return _V1["KVTierAgentLoopManagerTQ"]


def __getattr__(name: str):
    if name in ("KVTierAgentLoopManagerTQ", "KVTierAgentLoopWorkerTQ"):
        v1_manager_class()
        return _V1[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# How often a v1 trainer looks for finished samples. verl's replay buffer sleeps 2 s between looks, so a step's
# `timing_s/gen` is the rollout rounded up to the next 2 s (CPU rollouts of 8-18 s read 8.04, 10.05, 12.05 s:
# a 2x faster rollout measured as ~1.6x); a look is one metadata read of the TransferQueue.
SAMPLE_POLL_SECONDS = 0.1


class KVTierMetricsMixin:
    """For verl's v1 trainers: after verl's own metrics, the step's eviction metrics from the samples'
    `extra_fields` in the TransferQueue (read before the trainer clears them).

    `kvtier_<mode>` behaves as verl's `<mode>`: verl's trainer base compares `trainer_mode` with "sync" (the
    replay buffer's class, single-prompt refills, TransferQueue checkpoints), so a mode named `kvtier_sync`
    would run the async paths; the mode is set to `<mode>` before the replay buffer is built (the first use,
    right after `__init__` reads it), and the buffer polls every SAMPLE_POLL_SECONDS."""

    def _build_replay_buffer(self):
        base = self.trainer_mode.removeprefix("kvtier_")
        if base != self.trainer_mode:
            self.trainer_mode = base
            self.parameter_sync_step = self.config.trainer.v1.get(base, {}).get("parameter_sync_step", 1)
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):          # a custom sampler (trainer.v1.sampler.custom_sampler) may have none
            buffer.poll_interval = min(buffer.poll_interval, SAMPLE_POLL_SECONDS)
        return buffer

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        try:
            kv = v1_eviction_metrics(batch)
            metrics.update(kv)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a training step
            logger.warning("kvtier: eviction metrics unavailable this step: %s", exc)
            return
        try:                      # the same numbers on the rollout dashboard (Ray metrics, scraped)
            if not hasattr(self, "_kvtier_learner_exporter"):
                self._kvtier_learner_exporter = learner_exporter(getattr(self, "config", None))
            export_learner_metrics(self._kvtier_learner_exporter, kv)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kvtier: learner metrics not exported: %s", exc)


def learner_exporter(config):
    """The trainer process's `LearnerMetricsExporter`, labelled with `rollout.custom.kvtier.learner`."""
    from kvtier.observability.exporters import LearnerMetricsExporter

    learner = "dense"
    if config is not None:
        learner = KVTierRolloutSettings.from_rollout_config(config.actor_rollout_ref.rollout).learner
    return LearnerMetricsExporter(learner)


def export_learner_metrics(exporter, metrics: dict[str, float], prefix: str = "rollout/kvtier") -> None:
    """Send one step's `mismatch/*` and `replay/*` entries of the logged metrics to the exporter."""
    exporter.step(*learner_entries(metrics, prefix))


def v1_eviction_metrics(batch, kv_batch_get=None) -> dict[str, float]:
    """Eviction metrics of a v1 `KVBatchMeta` (padding samples left out)."""
    if kv_batch_get is None:
        import transfer_queue as tq

        kv_batch_get = tq.kv_batch_get
    keep = [not tag.get("is_padding", False) for tag in batch.tags]
    data = kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    fields = data["extra_fields"]
    fields = fields.tolist() if hasattr(fields, "tolist") else list(fields)
    out = eviction_metrics_from_fields([f for f, k in zip(fields, keep) if k])
    try:                                   # learner vs sampler, once old log-probs exist (not in bypass mode)
        lp = kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                          select_fields=["old_log_probs", "rollout_log_probs", "response_mask"])
        old, rollout, mask = (_padded(lp[k]) for k in ("old_log_probs", "rollout_log_probs", "response_mask"))
        rows = torch.tensor(keep, dtype=torch.bool)
        out.update(mismatch_metrics(old[rows], rollout[rows], mask[rows]))
    except Exception as exc:  # noqa: BLE001 - a field verl did not write this step (bypass mode, no log-probs)
        logger.info("kvtier: no learner/rollout mismatch metrics this step: %s", exc)
    try:                                   # groups whose rewards differ (GRPO's signal)
        g = kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "rm_scores"])
        uids = g["uid"].tolist() if hasattr(g["uid"], "tolist") else list(g["uid"])
        scores = _padded(g["rm_scores"]).sum(-1).tolist()
        out.update(group_signal_metrics([u for u, k in zip(uids, keep) if k], [s for s, k in zip(scores, keep) if k]))
    except Exception as exc:  # noqa: BLE001
        logger.info("kvtier: no GRPO group metrics this step: %s", exc)
    return out


def _padded(x):
    """The TransferQueue keeps per-token fields as nested (jagged) tensors: right-padded with zeros."""
    return x.to_padded_tensor(0.0) if getattr(x, "is_nested", False) else x


def register_v1_trainers() -> list[str]:
    """Register `kvtier_<mode>` for every v1 trainer mode verl registered (idempotent); the names."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    names = []
    for mode, cls in list(TRAINER_REGISTRY.items()):
        if mode.startswith("kvtier_"):
            continue
        name = f"kvtier_{mode}"
        if name not in TRAINER_REGISTRY:
            register_trainer(name)(type(f"KVTier{cls.__name__}", (KVTierMetricsMixin, cls), {}))
        names.append(name)
    return names


def _register_v1_if_available() -> None:
    import importlib.util

    if importlib.util.find_spec("transfer_queue") is None:
        return
    try:
        register_v1_trainers()
    except Exception as exc:  # noqa: BLE001 - never break the import (v0 trainers, agent-loop workers)
        logger.warning("kvtier: could not register the kvtier_<mode> v1 trainers: %s", exc)


_register_v1_if_available()
