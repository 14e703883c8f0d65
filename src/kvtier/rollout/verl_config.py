"""Compose verl configs from `src/kvtier/configs/rollout/` (Hydra, as `verl.trainer.main_ppo` does) and run on
them the checks verl makes before any weight loads (`validate_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import kvtier

CONFIG_DIR = Path(kvtier.__file__).resolve().parent / "configs" / "rollout"
GRPO_CONFIG = "kvtier_grpo"
GPU_RECIPE = "kvtier_grpo_qwen3_4b_32k"     # Qwen3-4B, 32k responses, learner replay, one 8-GPU node (docs/rl.md)
VERL_DEFAULT_ATTENTION = "flash_attention_2"  # what verl's HFModelConfig asks transformers for when none is set
AGENT_LOOP_MANAGER = "kvtier.rollout.trainer_hooks.KVTierAgentLoopManager"


def compose_config(overrides: Iterable[str] = (), config_name: str = GRPO_CONFIG):
    """The full verl trainer config (DictConfig) with kvtier's rollout settings and `overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def validate_config(cfg) -> dict[str, Any]:
    """Check a composed trainer config the way `python -m verl.trainer.main_ppo` and its workers would before
    any weight loads. No GPU, Ray or weights are needed. `actor_rollout_ref.model.path` must hold a config.json
    and a tokenizer.

    In order: verl's own `validate_config`, as main_ppo calls it. Then the dataclass conversions verl's engine
    workers make: model, actor, reference (with the workers' renames), rollout, checkpoint engine and algorithm.
    Then the asserts verl makes later at run time: the actor's and the rollout's dynamic-batch flags agree, a
    micro-batch holds one whole prompt + response, and rollout correction needs the rollout's log-probs.
    Then the model: transformers builds it (on the meta device) with the configured attention implementation,
    which fails for one this environment lacks (verl's default flash_attention_2 without flash-attn), and
    rollout.max_model_len fits both the sequence and the model's positions. For rollout.name=kvtier, kvtier's
    rollout settings must parse and the learner must agree with model_type. The replay engine's refusals apply,
    a protected prompt must fit in K, and the response must be longer than K (otherwise nothing is evicted).

    Raises on the first failure, naming the setting: verl raises AssertionError, ValueError or Hydra's
    InstantiationException, kvtier raises ValueError. Returns the values it checked."""
    import torch
    from omegaconf import OmegaConf, open_dict
    from transformers import AutoModelForCausalLM
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.config import validate_config as verl_validate_config
    from verl.utils.device import auto_set_device

    from kvtier.deathtime import register

    register()                                   # kvtier's attention, as the plugin registers it in each worker
    auto_set_device(cfg)
    use_ref = need_reference_policy(cfg)
    verl_validate_config(config=cfg, use_reference_policy=use_ref, use_critic=need_critic(cfg))
    arr, data = cfg.actor_rollout_ref, cfg.data
    model = omega_conf_to_dataclass(arr.model)
    actor = omega_conf_to_dataclass(arr.actor)
    if use_ref:                                  # verl.workers.engine_workers: the reference's fields renamed
        ref = OmegaConf.create(OmegaConf.to_container(arr.ref, resolve=True))
        with open_dict(ref):
            ref.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
            ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
            ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
            ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
            ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
        omega_conf_to_dataclass(ref)
    rollout = omega_conf_to_dataclass(arr.rollout)
    omega_conf_to_dataclass(arr.rollout.checkpoint_engine)
    omega_conf_to_dataclass(cfg.algorithm)
    correction = cfg.algorithm.get("rollout_correction") or {}
    if correction:
        omega_conf_to_dataclass(correction, RolloutCorrectionConfig)

    sequence = int(data.max_prompt_length) + int(data.max_response_length)
    if bool(arr.actor.use_dynamic_bsz) != bool(arr.rollout.log_prob_use_dynamic_bsz):
        raise ValueError("actor_rollout_ref.actor.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz differ "
                         "(verl's engine workers assert they agree)")
    if arr.actor.use_dynamic_bsz:
        budgets = {"actor.ppo_max_token_len_per_gpu": arr.actor.ppo_max_token_len_per_gpu,
                   "rollout.log_prob_max_token_len_per_gpu": arr.rollout.log_prob_max_token_len_per_gpu}
        if use_ref and arr.ref.log_prob_use_dynamic_bsz:
            budgets["ref.log_prob_max_token_len_per_gpu"] = arr.ref.log_prob_max_token_len_per_gpu
        for key, tokens in budgets.items():
            if tokens is None or int(tokens) < sequence:
                raise ValueError(f"actor_rollout_ref.{key}={tokens} < data.max_prompt_length + max_response_length "
                                 f"= {sequence}: verl's dynamic batching needs one whole sequence per micro-batch")
    if (correction.get("rollout_is") or correction.get("rollout_rs")) and not arr.rollout.calculate_log_probs:
        raise ValueError("algorithm.rollout_correction needs actor_rollout_ref.rollout.calculate_log_probs=true")

    hf = model.hf_config
    attn = (model.override_config or {}).get("attn_implementation", VERL_DEFAULT_ATTENTION)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(hf, attn_implementation=attn)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"actor_rollout_ref.model.override_config.attn_implementation={attn} is not usable "
                         f"here (verl's default when unset: {VERL_DEFAULT_ATTENTION}): {exc}") from exc
    positions = getattr(hf, "max_position_embeddings", None)
    if rollout.max_model_len is not None and not sequence <= rollout.max_model_len <= (positions or sequence):
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} must hold prompt + "
                         f"response ({sequence}) within the model's {positions} positions")

    checked = dict(n_gpus=int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes), sequence=sequence,
                   response_length=int(data.max_response_length), attn_implementation=attn,
                   model_type=model.model_type, rollout_is=correction.get("rollout_is"),
                   use_dynamic_bsz=actor.use_dynamic_bsz, budget=None, learner=None)
    if rollout.name == "kvtier":
        checked.update(_check_kvtier(cfg, model, actor))
    return checked


def _check_kvtier(cfg, model, actor) -> dict[str, Any]:
    """kvtier's start-up checks for rollout.name=kvtier (`validate_config`)."""
    from kvtier.engine.config import validate_request

    from .learner_replay import MODEL_TYPES, check_engine_config, check_learner_config
    from .settings import KVTierRolloutSettings

    settings = KVTierRolloutSettings.from_rollout_config(cfg.actor_rollout_ref.rollout)
    check_learner_config(settings.learner, model.model_type)
    if model.model_type in MODEL_TYPES:
        check_engine_config(model, actor.engine)
    spec = settings.eviction.default
    if spec.compressed:
        validate_request(spec, int(cfg.data.max_prompt_length))
        if int(cfg.data.max_response_length) <= spec.budget:
            raise ValueError(f"data.max_response_length={cfg.data.max_response_length} is not above "
                             f"actor_rollout_ref.rollout.custom.kvtier.budget={spec.budget}: no sample would be "
                             "evicted")
    return dict(budget=spec.budget if spec.compressed else None, learner=settings.learner)


def cpu_rollout_overrides(model_path: str, *, budget: int | None, buffer: int = 64, policy: str = "random",
                          prompt_length: int = 256, response_length: int = 256, n: int = 1,
                          kv_cache_bytes: int = 64 << 20, max_num_seqs: int = 16, num_agent_workers: int = 1,
                          audit_log: str | None = None, temperature: float = 1.0, seed: int | None = None,
                          max_model_len: int | None = None, protect: str | int | None = None,
                          val_budget: str | int | None = None) -> list[str]:
    """Overrides that make the config runnable on one CPU node with a small model (demo, tests). The agent
    loop manager is kvtier's (validation budget, eviction metrics in the trainer's timing)."""
    null = "null"
    r = "actor_rollout_ref.rollout"
    extra = []
    if protect is not None:
        extra.append(f"++{r}.custom.kvtier.protect={protect}")
    if val_budget is not None:
        extra.append(f"++{r}.custom.kvtier.val_budget={val_budget}")
    return extra + [
        f"++{r}.agent.agent_loop_manager_class={AGENT_LOOP_MANAGER}",
        f"actor_rollout_ref.model.path={model_path}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"{r}.nnodes=1",
        f"{r}.n_gpus_per_node=1",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.n={n}",
        f"{r}.temperature={temperature}",
        f"{r}.load_format=auto",          # standalone servers load the checkpoint (hybrid ones get weights synced)
        f"{r}.enforce_eager=true",
        f"++{r}.enable_sleep_mode=false",  # no vLLM sleep mode on CPU (not in verl's yaml: ++)
        f"{r}.free_cache_engine=false",
        f"{r}.max_model_len={max_model_len or prompt_length + response_length}",
        f"{r}.max_num_seqs={max_num_seqs}",
        f"{r}.max_num_batched_tokens={max(2048, prompt_length + response_length)}",
        f"{r}.agent.num_workers={num_agent_workers}",
        f"{r}.custom.kvtier.policy={policy}",
        f"{r}.custom.kvtier.budget={budget if budget is not None else null}",
        f"{r}.custom.kvtier.buffer={buffer}",
        f"{r}.custom.kvtier.seed={seed if seed is not None else null}",
        f"{r}.custom.kvtier.kv_cache_bytes={kv_cache_bytes}",
        f"{r}.custom.kvtier.audit_log={audit_log if audit_log else null}",
    ]
