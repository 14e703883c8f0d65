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
forward re-derives its micro-batch's deaths one sample at a time on the host and writes them into the
micro-batch's tensor on the learner's device (host peak: one sample's tensor and the simulation's scratch;
`kvtier bench replay-memory`). A sample the learner cannot replay goes
down the dense path and is counted (`replay_status`): full attention, a cache rebuilt mid-generation
(`rebuilt`: a preemption's recompute), several generate calls (`multi_call`: each turn drew its own
evictions), a policy that reads the cache (`policy`), or no kvtier per-sample fields (`no_record`: the
agent-loop manager is not kvtier's).

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

import json
import logging
from contextlib import contextmanager
from typing import Any, Mapping

import torch
from torch import Tensor

logger = logging.getLogger("kvtier.rollout")

MODEL_TYPE = "kvtier_replay"
FULL_REF_MODEL_TYPE = "kvtier_replay_full_ref"     # the actor replays; the reference scores at full attention
MODEL_TYPES = (MODEL_TYPE, FULL_REF_MODEL_TYPE)
BASE_MODEL_TYPE = "language_model"
REPLAYABLE_POLICIES = ("random",)       # policies whose records are re-derived (and tested equal to the engine's)
STATUSES = ("replayed", "full", "rebuilt", "multi_call", "policy", "no_record")
FIELDS = ("kvtier_budget", "kvtier_seed", "kvtier_buffer", "kvtier_policy", "kvtier_policy_params",
          "kvtier_preemptions", "kvtier_generate_calls")


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


def replay_status(fields: Mapping[str, Any]) -> str:
    """How the learner scores one sample, from its per-sample fields (one of STATUSES)."""
    if fields.get("kvtier_budget") is None:
        return "full"
    if fields.get("kvtier_seed") is None or fields.get("kvtier_generate_calls") is None:
        return "no_record"
    if int(fields.get("kvtier_preemptions") or 0) > 0:
        return "rebuilt"
    if int(fields["kvtier_generate_calls"]) > 1:
        return "multi_call"
    if fields.get("kvtier_policy") not in REPLAYABLE_POLICIES:
        return "policy"
    return "replayed"


def sample_deaths(fields: Mapping[str, Any], prompt_len: int, length: int, num_layers: int,
                  num_kv_heads: int) -> Tensor | None:
    """[layers, kv_heads, length] int32 death times of a replayed sample; None for the dense path."""
    if replay_status(fields) != "replayed":
        return None
    from kvtier.deathtime import simulate_deaths
    from kvtier.policies import EvictionSchedule, make_policy

    # Not cached: at 32k tokens a sample's tensor is ~37 MB, a 256-sample batch's ~9.6 GB of host memory.
    # Re-deriving costs ~1.3 s per 32k sample on one CPU core (old log-probs, then each PPO epoch).
    policy = make_policy(str(fields["kvtier_policy"]), **json.loads(fields.get("kvtier_policy_params") or "{}"))
    return simulate_deaths(policy, EvictionSchedule(int(fields["kvtier_budget"]), int(fields["kvtier_buffer"])),
                           int(prompt_len), int(length), num_layers=int(num_layers), num_kv_heads=int(num_kv_heads),
                           seed=int(fields["kvtier_seed"]))


def batch_fields(micro_batch) -> list[dict[str, Any]]:
    """Each sample's kvtier fields from a verl micro-batch: the v1 trainer's `extra_fields` column (one dict per
    sample) or the v0 trainer's one column per key (DataProto's non-tensor batch)."""
    keys = set(micro_batch.keys())
    n = micro_batch.batch_size[0]
    if "extra_fields" in keys:
        col = _as_list(micro_batch["extra_fields"])
        return [{k: (row or {}).get(k) for k in FIELDS} for row in col]
    cols = {k: _as_list(micro_batch[k]) for k in FIELDS if k in keys}
    return [{k: cols[k][b] if k in cols else None for k in FIELDS} for b in range(n)]


def _as_list(value) -> list:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value)


def prompt_lengths(micro_batch) -> list[int]:
    """Each sample's prompt length: the v1 trainer keeps `prompts` as a nested (jagged) tensor; the v0
    trainer's batch has the left-padded prompt's ones in `attention_mask` before the response columns."""
    keys = set(micro_batch.keys())
    if "prompts" in keys and micro_batch["prompts"].is_nested:
        return micro_batch["prompts"].offsets().diff().tolist()
    if "attention_mask" in keys and "response_mask" in keys and not micro_batch["attention_mask"].is_nested:
        attn, resp = micro_batch["attention_mask"], micro_batch["response_mask"]
        responses = int(micro_batch.get_non_tensor("max_response_len")) if resp.is_nested else resp.shape[-1]
        return [int(x) for x in attn[:, : attn.shape[-1] - responses].sum(-1).tolist()]
    raise ValueError(f"kvtier learner replay: no prompt lengths in the micro-batch (keys: {sorted(keys)})")


def micro_batch_deaths(micro_batch, width: int, *, packed: bool, num_layers: int, num_kv_heads: int,
                       device: torch.device | str = "cpu") -> tuple[Tensor | None, dict[str, int]]:
    """The death tensor for one forward of verl's engine, on `device`, and how many samples took each path.

    padded (use_remove_padding=false): [B, layers, kv_heads, width], sample b in columns 0..len_b-1;
    packed (true): [1, layers, kv_heads, width], sample b at its cu_seqlens offset and every key dead at its
    segment's end. None when no sample is replayed (the layer runs plain SDPA). Samples are simulated one at
    a time on the host and copied in: the host holds one sample's tensor at a time."""
    from kvtier.deathtime import NEVER

    fields = batch_fields(micro_batch)
    offsets = micro_batch["input_ids"].offsets().tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    statuses = [replay_status(f) for f in fields]
    counts = {s: statuses.count(s) for s in STATUSES}
    if "replayed" not in statuses:
        return None, counts
    prompts = prompt_lengths(micro_batch)
    out = torch.full((1 if packed else len(fields), num_layers, num_kv_heads, width), NEVER, dtype=torch.int32,
                     device=device)
    for b, (f, status) in enumerate(zip(fields, statuses)):
        start = offsets[b] if packed else 0
        end = start + lengths[b]
        row = out[0 if packed else b, :, :, start:end]
        if status != "replayed":
            if packed:
                row.fill_(end)                          # full attention inside its own segment only
            continue
        rec = sample_deaths(f, prompts[b], lengths[b], num_layers, num_kv_heads)
        shifted = torch.where(rec == NEVER, rec, rec + start)
        row.copy_(shifted.clamp(max=end) if packed else shifted)
        del rec, shifted
    return out, counts


LEARNER_METRICS = "actor/kvtier_replay"


def learner_shares(counts: dict[str, int]) -> dict[str, Any]:
    """One forward's share of samples per replay status as verl `Metric`s (mean over micro-batches and ranks)."""
    from verl.utils.metric.utils import Metric

    total = sum(counts.values()) or 1
    return {f"{LEARNER_METRICS}/{status}_share": Metric("mean", counts.get(status, 0) / total) for status in STATUSES}


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
        raise ReplayConfigError(f"model_type={MODEL_TYPE}: actor_rollout_ref.actor.ulysses_sequence_parallel_size="
                                f"{sp} is not supported (the death tensor is not split across sequence shards); "
                                "set it to 1")


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

        def prepare_model_inputs(self, micro_batch):
            from kvtier.deathtime.attention import DEATHS_KWARG

            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            if self.scores_at_full_attention():
                self._replay_counts = None
                return model_inputs, output_args
            hf = self.model_config.hf_config
            ids = model_inputs["input_ids"]
            deaths, counts = micro_batch_deaths(
                micro_batch, ids.shape[-1], packed=model_inputs.get("attention_mask") is None,
                num_layers=hf.num_hidden_layers,
                num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads, device=ids.device)
            if not self._replay_logged:                  # one line: replay is on, and what it found
                self._replay_logged = True
                logger.warning("kvtier learner replay: first micro-batch (%s, %d columns): %s", "packed" if
                               model_inputs.get("attention_mask") is None else "padded", ids.shape[-1],
                               {k: v for k, v in counts.items() if v})
            if deaths is not None:
                model_inputs[DEATHS_KWARG] = deaths
            self._replay_counts = counts
            return model_inputs, output_args

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
