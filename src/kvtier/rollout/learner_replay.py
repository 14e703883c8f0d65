"""Learner replay: verl's FSDP actor computes its log-probs under each rollout sample's own eviction.

The engine that sampled a token had evicted part of the cache; a dense learner scores it with every key in
view, so sampler and learner disagree (the mismatch Sparse-RL and Sparrow correct with rejection and
reweighting). With replay the learner attends exactly as the sampler did: key j is visible to query i iff
j <= i < deaths[layer, head, j] (`kvtier.deathtime`), so old and new log-probs are those of the policy under
the cache it is served with, and the rollout's log-probs agree with the learner's up to numerics.

**The record** travels as four integers per sample (`kvtier_seed`, `kvtier_budget`, `kvtier_buffer`,
`kvtier_policy` + `kvtier_policy_params`, the server's per-sample fields): `random`'s evictions are a function
of the request's keyed draw and schedule, so the learner re-derives the [layers, kv_heads, length] death
tensor (`kvtier.deathtime.simulate_deaths`, equal to the engine's audit log: tests/test_rollout.py) instead
of receiving ~37 MB per sample at Qwen3-4B shapes and 32k tokens. Nothing dense is kept for the batch: each
forward builds its micro-batch's deaths one sample at a time on the host, derived once per step (by background
workers as soon as a forward receives its batch: `replay_prefetch`) and kept compactly in a bounded store
(`replay_batch`), and writes them into the micro-batch's tensor on the learner's device (`kvtier bench
replay-memory`). A sample generated on several caches (a preemption's recompute, tool turns, resumed partial
rollouts) is replayed by segment from its `kvtier_segments` record: one forward row per segment that evicted,
each token's log-prob taken from its own segment's row (`replay_segments`). A sample the learner cannot replay
goes down the dense path and is counted (`replay_status`): full attention, a rebuilt cache or several generate
calls without a segment record (`rebuilt`, `multi_call`), a policy that reads the cache (`policy`), or no
kvtier per-sample fields (`no_record`: the agent-loop manager is not kvtier's).

**Where it hooks in** (no verl file changed): verl's `EngineRegistry` builds the actor's (and the
reference's) training engine by `actor_rollout_ref.model.model_type`; `register_engine` adds
`model_type=kvtier_replay` for the FSDP/FSDP2 backends, a subclass of verl's `FSDPEngineWithLMHead` whose
`prepare_model_inputs` adds the batch's death tensor as the `kvtier_deaths` forward kwarg, which transformers
hands to the attention function registered as `kvtier_deathtime` (`model.override_config.attn_implementation`).
Padded batches (`use_remove_padding=false`) and packed ones (`true`: each sample's keys die at its segment's
end, so no sample sees another's) are both handled; Ulysses sequence parallelism is refused by name.

A GPU user sets, next to `rollout.name=kvtier`:

    actor_rollout_ref.rollout.custom.kvtier.learner=replay
    +actor_rollout_ref.model.model_type=kvtier_replay
    +actor_rollout_ref.model.override_config.attn_implementation=kvtier_deathtime
    actor_rollout_ref.rollout.agent.agent_loop_manager_class=kvtier.rollout.trainer_hooks.KVTierAgentLoopManager

and the replica refuses a `learner` that disagrees with `model_type` (`check_learner_config`).

**The reference at full attention** (`model_type=kvtier_replay_full_ref`, the anchor of issue #38): verl builds
the reference policy from a copy of the actor's model config, so under `kvtier_replay` its log-probs are
replayed too and the KL loss anchors only the evicted policy. Under `kvtier_replay_full_ref` the actor still
replays every sample while the reference scores each one with every key in view: in verl's separate reference
engine (`engine.forward_only`) and, with LoRA, inside the actor's engine while the adapter is disabled (where
verl computes the reference). The KL loss then pulls the evicted policy toward the start model's full-attention
behaviour.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

from .replay_batch import (STORE_BYTES, batch_fields, micro_batch_deaths, prompt_lengths, replay_rows,  # noqa: F401
                           replay_store, sample_deaths, stored_sample_deaths)
from .replay_prefetch import current_store, prefetch_batch
from .replay_segments import expand_micro_batch, expands, gather_outputs
from .replay_status import FIELDS, REPLAYABLE_POLICIES, STATUSES, by_segment, replay_status  # noqa: F401

logger = logging.getLogger("kvtier.rollout")

MODEL_TYPE = "kvtier_replay"
FULL_REF_MODEL_TYPE = "kvtier_replay_full_ref"     # the actor replays; the reference scores at full attention
MODEL_TYPES = (MODEL_TYPE, FULL_REF_MODEL_TYPE)
BASE_MODEL_TYPE = "language_model"


class ReplayConfigError(ValueError):
    """A setting the learner replay has not been built for; the message names it."""


def check_learner_config(learner: str, model_type: str | None) -> None:
    """The rollout's `learner` and the actor's `model_type` must say the same thing (raises otherwise)."""
    replay_engine = model_type in MODEL_TYPES
    if (learner == "replay") != replay_engine:
        raise ReplayConfigError(
            f"actor_rollout_ref.rollout.custom.kvtier.learner={learner} but actor_rollout_ref.model.model_type="
            f"{model_type}: learner replay needs model_type={MODEL_TYPE} or {FULL_REF_MODEL_TYPE} (the engines "
            f"that replay), and those engines need learner=replay")


LEARNER_METRICS = "actor/kvtier_replay"


BY_SEGMENT = "replayed_by_segment"      # the replayed samples scored by segment (a subset of `replayed`)


def learner_shares(counts: dict[str, int]) -> dict[str, Any]:
    """One forward's share of samples per replay status as verl `Metric`s (mean over micro-batches and ranks),
    and of those replayed by segment when `counts` has BY_SEGMENT."""
    from verl.utils.metric.utils import Metric

    total = sum(counts.get(status, 0) for status in STATUSES) or 1
    keys = STATUSES + ((BY_SEGMENT,) if BY_SEGMENT in counts else ())
    return {f"{LEARNER_METRICS}/{key}_share": Metric("mean", counts.get(key, 0) / total) for key in keys}


def check_engine_config(model_config, engine_config) -> None:
    """Refuse, naming the setting, what the replay engine has not been built for."""
    from kvtier.deathtime import ATTN_NAME

    attn = (getattr(model_config, "override_config", None) or {}).get("attn_implementation")
    if attn != ATTN_NAME:
        raise ReplayConfigError(f"model_type={MODEL_TYPE} needs +actor_rollout_ref.model.override_config."
                                f"attn_implementation={ATTN_NAME} (got {attn!r}): the attention that reads the "
                                "death times")
    sp = int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        # verl 0.9.1's Ulysses (models/transformers/monkey_patch.apply_monkey_patch) puts its all-to-all into
        # transformers' flash-attention path only; gloo has all_to_all, so CPU is not what is missing (docs/rl.md)
        raise ReplayConfigError(f"model_type={MODEL_TYPE}: actor_rollout_ref.actor.ulysses_sequence_parallel_size="
                                f"{sp} is not supported: verl's Ulysses swaps sequence shards for head shards only "
                                "inside transformers' flash-attention path (transformers.integrations.flash_attention."
                                f"_flash_attention_forward), not in {ATTN_NAME}, so each rank would attend within its "
                                "own sequence shard; set it to 1")


def replay_engine_class(base: type) -> type:
    """verl's `FSDPEngineWithLMHead` (`base`) computing its forwards under each sample's recorded eviction."""

    class KVTierReplayEngine(base):
        def __init__(self, model_config, engine_config, *args, **kwargs):
            from kvtier.deathtime import register

            check_engine_config(model_config, engine_config)
            register()
            # the registry has picked this class by model_type; verl builds the module by the base name
            self._full_ref = getattr(model_config, "model_type", None) == FULL_REF_MODEL_TYPE
            self._reference_engine = bool(getattr(engine_config, "forward_only", False))
            self._adapter_disabled = False
            model_config.model_type = BASE_MODEL_TYPE
            super().__init__(model_config, engine_config, *args, **kwargs)
            self._replay_logged = False
            self._replay_counts = None
            self._expansion = None            # (expanded micro-batch, its rows) between inputs and outputs
            if self._full_ref and self._reference_engine:
                logger.warning("kvtier learner replay: the reference policy scores at full attention (%s)",
                               FULL_REF_MODEL_TYPE)

        def scores_at_full_attention(self) -> bool:
            """True for the reference's forwards under `kvtier_replay_full_ref`: verl's separate reference
            engine, or the actor's engine with its LoRA adapter disabled (verl's reference under LoRA)."""
            return self._full_ref and (self._reference_engine or self._adapter_disabled)

        @contextmanager
        def disable_adapter(self):
            with super().disable_adapter():
                self._adapter_disabled = True
                try:
                    yield
                finally:
                    self._adapter_disabled = False

        def _shape(self) -> tuple[int, int]:
            hf = self.model_config.hf_config
            return hf.num_hidden_layers, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            """verl's loop over the batch's micro-batches, after queueing every replayed sample of the batch for
            the background workers (`replay_prefetch`): the micro-batches' forwards then wait only for samples
            not derived yet."""
            if not self.scores_at_full_attention():
                prefetch_batch(data, *self._shape())
            return super().forward_backward_batch(data, loss_function, forward_only)

        def prepare_model_inputs(self, micro_batch):
            """verl's inputs plus the death tensor; a micro-batch with samples replayed by segment is first
            expanded into one row per segment that evicted (`replay_segments`), and verl's inputs are built
            for those rows."""
            from kvtier.deathtime.attention import DEATHS_KWARG

            self._expansion = None
            if self.scores_at_full_attention():
                self._replay_counts = None
                return super().prepare_model_inputs(micro_batch)
            rows = replay_rows(micro_batch)
            batch = micro_batch
            if expands(rows):
                batch = expand_micro_batch(micro_batch, rows)
                self._expansion = (batch, rows)
            model_inputs, output_args = super().prepare_model_inputs(batch)
            ids = model_inputs["input_ids"]
            layers, heads = self._shape()
            deaths, counts = micro_batch_deaths(
                micro_batch, ids.shape[-1], packed=model_inputs.get("attention_mask") is None, num_layers=layers,
                num_kv_heads=heads, device=ids.device, store=current_store(), rows=rows)
            counts[BY_SEGMENT] = sum(by_segment(f) for f in batch_fields(micro_batch))
            if not self._replay_logged:                  # one line: replay is on, and what it found
                self._replay_logged = True
                logger.warning("kvtier learner replay: first micro-batch (%s, %d columns, %d rows): %s", "packed"
                               if model_inputs.get("attention_mask") is None else "padded", ids.shape[-1],
                               len(rows), {k: v for k, v in counts.items() if v})
            if deaths is not None:
                model_inputs[DEATHS_KWARG] = deaths
            self._replay_counts = counts
            return model_inputs, output_args

        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            """verl's outputs; for an expanded micro-batch, computed on its rows and gathered back into the
            samples' (each token from its own segment's row)."""
            if self._expansion is None:
                return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            batch, rows = self._expansion
            self._expansion = None
            out = super().prepare_model_outputs(output, output_args, batch, logits_processor_func)
            offsets = micro_batch["input_ids"].offsets()
            return gather_outputs(out, rows, offsets.diff().tolist(), offsets)

        def forward_step(self, micro_batch, loss_function, forward_only):
            """verl's forward, plus what this forward did with each sample: `actor/kvtier_replay/<status>_share`
            (the learner's own count, not the rollout's records), averaged by verl over micro-batches and
            ranks like its own losses."""
            loss, output = super().forward_step(micro_batch, loss_function, forward_only)
            if self._replay_counts is not None:           # None: the reference at full attention
                output.setdefault("metrics", {}).update(learner_shares(self._replay_counts))
            return loss, output

    KVTierReplayEngine.__qualname__ = KVTierReplayEngine.__name__
    return KVTierReplayEngine


def register_engine(module) -> None:
    """Register `model_type=kvtier_replay` with verl's EngineRegistry for every device verl's own FSDP engine
    is registered for (`module`: verl.workers.engine.fsdp.transformer_impl, right after its import)."""
    from kvtier.deathtime import register
    from verl.workers.engine.base import EngineRegistry

    register()
    if _REGISTERED:
        return
    cls = replay_engine_class(module.FSDPEngineWithLMHead)
    for model_type in MODEL_TYPES:
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=["cuda", "npu", "cpu"])(cls)
    _REGISTERED.append(cls)


_REGISTERED: list[type] = []


def install() -> None:
    """Register the engine when verl's FSDP engine module is imported (now, if it already is)."""
    from .import_hooks import when_imported

    when_imported("verl.workers.engine.fsdp.transformer_impl", register_engine,
                  ready=lambda m: hasattr(m, "FSDPEngineWithValueHead"))
