"""`kvtier rollout demo` and `kvtier rl smoke`."""

from __future__ import annotations

import math
from typing import Optional

import typer

rollout_app = typer.Typer(no_args_is_help=True, help="verl rollouts on the compressed engine (rollout.name=kvtier).")


@rollout_app.command("demo")
def demo(
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the tiny Qwen3, built if missing)."),
    budget: Optional[int] = typer.Option(64, help="K per KV head; 0 = full attention."),
    buffer: int = typer.Option(16, help="r: protected recent tokens and round cadence."),
    policy: str = typer.Option("random", help="Eviction policy."),
    batch_size: int = typer.Option(4, help="Prompts in the DataProto batch."),
    response_length: int = typer.Option(256, help="Tokens generated per sample (tiny model never stops early)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy)."),
    kv_cache_mb: int = typer.Option(64, help="KV pool size in MiB."),
) -> None:
    """Generate a batch of rollouts through verl's agent loop on the kvtier backend; print per-sample stats."""
    from kvtier.rollout.cpu.demo import run_demo

    run_demo(model=model, budget=budget or None, buffer=buffer, policy=policy, batch_size=batch_size,
             response_length=response_length, temperature=temperature, kv_cache_bytes=kv_cache_mb << 20,
             echo=typer.echo)


rl_app = typer.Typer(no_args_is_help=True, help="RL training with verl's trainer on kvtier rollouts.")


@rl_app.command("smoke")
def smoke(
    steps: int = typer.Option(3, help="Trainer steps (GRPO updates)."),
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the tiny Qwen3, built if missing)."),
    workdir: Optional[str] = typer.Option(None, help="Where data, logs, metrics and events go (default: a temp dir)."),
    batch_size: int = typer.Option(4, help="Prompts per step (data.train_batch_size)."),
    n: int = typer.Option(2, help="Samples per prompt (GRPO group size)."),
    response_length: int = typer.Option(200, help="Response tokens (the tiny model rarely stops early)."),
    budget: int = typer.Option(64, help="K per KV head (small, so eviction happens)."),
    buffer: int = typer.Option(16, help="r: protected recent tokens and round cadence."),
    lr: float = typer.Option(1e-3, help="Actor learning rate (large enough that each sync changes the weights)."),
    check_tokens: int = typer.Option(16, help="Tokens of the post-sync log-prob check (0: skip it)."),
    timeout: float = typer.Option(1800, help="Seconds before the trainer is stopped."),
    trainer: str = typer.Option("v1", help="v1: verl's default trainer (trainer.use_v1=true, TransferQueue, "
                                "kvtier_sync mode); v0: its RayPPOTrainer (trainer.use_v1=false, DataProto)."),
    task: str = typer.Option("toy", help="toy: a toy reward any model earns; or a task family of "
                             "kvtier.tasks.chains and its graded reward (kvtier.rollout.chains_task): chains, the "
                             "reasoner's (--model src/kvtier/models/reasoner --response-length 1160), or chains-long "
                             "(2.5-4k-token traces: a model with >= 4,096 positions, --response-length 4000)."),
    learner: str = typer.Option("dense", help="dense: the actor scores every token with the whole context; "
                                "replay: under each sample's own eviction (kvtier.rollout.learner_replay)."),
    learner_dtype: str = typer.Option("fp32", help="The actor's and reference's compute dtype: fp32, or bf16 "
                                      "(verl's default; emulated, ~25x slower backward, on CPUs without native "
                                      "bf16)."),
    ref_attention: str = typer.Option("replay", help="With --learner replay, how the reference policy (the KL "
                                      "loss's anchor) scores: replay (under each sample's eviction, like the actor) "
                                      "or full (full attention: model_type=kvtier_replay_full_ref)."),
    full_share: float = typer.Option(0.0, help="Share of each GRPO group's samples generated at full attention "
                                     "(rollout.custom.kvtier.full_share; the first round(share * n) of a group)."),
    kl_coef: Optional[float] = typer.Option(None, help="actor.kl_loss_coef (default: kvtier_grpo.yaml's 0.001)."),
    rollout: str = typer.Option("kvtier", help="kvtier: kvtier's compressed engine (rollout.name=kvtier); vllm: "
                                "verl's own vLLM rollout, unchanged (rollout.name=vllm), at full attention."),
    rollout_dtype: str = typer.Option("auto", help="The rollout engine's dtype (rollout.dtype): auto = float32 on a "
                                      "CPU without AVX512-BF16/AMX (bf16 matmuls emulated there), verl's bfloat16 "
                                      "elsewhere; or float32, bfloat16, float16."),
) -> None:
    """Run verl's `main_ppo` (GRPO, hybrid engine, v1 or v0 trainer) on kvtier rollouts on CPU; one JSON line
    per step, then a JSON summary. Exit status 1 if the trainer fails or a check does not hold."""
    from .cpu.rl_smoke import LEARNER_DTYPES, ROLLOUT_DTYPES, TRAINERS, check_ref_attention, check_rollout, check_task, run_smoke

    if trainer not in TRAINERS:
        raise typer.BadParameter(f"--trainer must be one of {', '.join(TRAINERS)}")
    try:
        check_task(task)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from None
    if learner_dtype not in LEARNER_DTYPES:
        raise typer.BadParameter(f"--learner-dtype must be one of {', '.join(LEARNER_DTYPES)}")
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise typer.BadParameter(f"--rollout-dtype must be one of {', '.join(ROLLOUT_DTYPES)}")
    try:
        check_ref_attention(ref_attention, learner)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ref-attention") from None
    from .settings import parse_full_share

    try:
        parse_full_share(full_share)
    except ValueError as exc:                   # EvictionConfigError: the same rule verl's replica applies
        raise typer.BadParameter(str(exc), param_hint="--full-share") from None
    if rollout == "vllm" and budget:
        typer.echo(f"--rollout vllm: verl's vLLM rollout has no eviction; --budget {budget} ignored (full attention)",
                   err=True)
        budget = 0
    try:
        check_rollout(rollout, budget=budget or None, learner=learner, full_share=full_share)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rollout") from None
    result = run_smoke(steps=steps, model=model, workdir=workdir, batch_size=batch_size, n=n,
                       response_length=response_length, budget=budget or None, buffer=buffer, lr=lr,
                       check_tokens=check_tokens, timeout=timeout, echo=typer.echo, trainer=trainer, task=task,
                       learner=learner, learner_dtype=learner_dtype, ref_attention=ref_attention,
                       full_share=full_share, kl_coef=kl_coef, rollout=rollout, rollout_dtype=rollout_dtype)
    s = result["summary"]
    versions = s["weights_versions"]
    ok = s["returncode"] == 0 and s["steps"] == steps
    if rollout == "kvtier":               # what kvtier's server and hooks record (verl's vLLM server has neither)
        ok = ok and (all((r["eviction_events"] or 0) > 0 or not budget for r in result["steps"])
                     and all(_finite(r["rollout_is_mean"]) for r in result["steps"])
                     and len(versions) >= steps and all(a < b for a, b in zip(versions, versions[1:]))
                     and s["sleeps"] >= steps and s["wakes"] >= steps)
    raise typer.Exit(0 if ok else 1)


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def register(app: typer.Typer) -> None:
    """Add `kvtier rollout` and `kvtier rl` to the `kvtier` CLI."""
    app.add_typer(rollout_app, name="rollout")
    app.add_typer(rl_app, name="rl")
