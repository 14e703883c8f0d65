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
from .rl_smoke_overrides import (  # noqa: F401 - the settings' names and checks, as callers import them from here
    EXTERNAL_MODULES, LEARNER_DTYPES, REF_ATTENTIONS, ROLLOUT_DTYPES, ROLLOUTS, TRAINER_MODE, TRAINERS,
    VLLM_WORKER_EXTENSION, check_learner_dtype, check_ref_attention, check_rollout, check_rollout_dtype, check_sampling, check_task,
    external_modules, overrides, resolve_rollout_dtype)
from .rl_smoke_records import read_jsonl, step_record


def run_smoke(*, steps: int = 3, model: str | None = None, workdir: str | None = None, batch_size: int = 4,
              n: int = 2, prompt_length: int = 64, response_length: int = 200, budget: int | None = 64, buffer: int = 16,
              kv_cache_mb: int = 64, lr: float = 1e-3, check_tokens: int = 16, timeout: float = 1800,
              echo=print, extra_overrides: list[str] | None = None, trainer: str = "v1", task: str = "toy",
              learner: str = "dense", learner_dtype: str = "fp32", ref_attention: str = "replay",
              full_share: float = 0.0, kl_coef: float | None = None, rollout: str = "kvtier",
              rollout_dtype: str = "auto", temperature: float = 1.0, micro_batch: int | None = None) -> dict:
    """task "toy": `toy_task`'s prompts and reward (any model); a task family of kvtier.tasks.chains ("chains",
    "chains-long"): its problems and graded reward (`kvtier.rollout.chains_task`; the model must speak it,
    e.g. src/kvtier/models/reasoner for chains, and response_length hold its traces). `rollout_dtype`: the
    rollout engine's dtype, `auto` (float32 on a CPU without native bf16, where bf16 matmuls are emulated;
    verl's bfloat16 elsewhere) or a dtype name; `temperature`: the rollout's sampling temperature; `micro_batch`: samples per learner forward (None: all of a step's)."""
    import tempfile

    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, not {trainer!r}")
    check_task(task)
    check_ref_attention(ref_attention, learner)
    check_rollout(rollout, budget=budget, learner=learner, full_share=full_share)
    check_rollout_dtype(rollout_dtype)
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
    engine_dtype, why = resolve_rollout_dtype(rollout_dtype)
    if why:
        echo(why)
    args = overrides(model=model, train=train, val=val, workdir=work, steps=steps, batch_size=batch_size, n=n,
                     prompt_length=prompt_length, response_length=response_length, budget=budget, buffer=buffer,
                     kv_cache_mb=kv_cache_mb, lr=lr, env_vars={k: v for k, v in env_vars.items()}, trainer=trainer,
                     reward=reward, learner=learner, learner_dtype=learner_dtype, ref_attention=ref_attention,
                     full_share=full_share, kl_coef=kl_coef, rollout=rollout, rollout_dtype=engine_dtype,
                     temperature=temperature, micro_batch=micro_batch)
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
