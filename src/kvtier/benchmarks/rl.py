"""`kvtier bench rl`: what a compressed rollout costs in learning, and what learner replay buys back.

GRPO through verl's own trainer (`kvtier rl smoke --task chains`: the reasoner's task family, graded
reward, v1 trainer, hybrid engine; `--family` picks another family of kvtier.tasks.chains, e.g.
chains-long) from the same checkpoint, data and seeds in each arm, at equal KV memory:

* `full`   - kvtier rollouts at full attention (no eviction): what users run today;
* `dense`  - random eviction at K, the learner scores with the whole context, today's token TIS
             (`kvtier_grpo.yaml`: rollout_is=token, threshold 2; `--rejection` adds verl's rollout_rs);
* `replay` - random eviction at K, the learner scores under each sample's own eviction
             (`rollout.custom.kvtier.learner=replay`, kvtier.rollout.learner_replay).

Per step (from verl's logged metrics): reward, step and rollout seconds, the learner-vs-sampler per-token
ratio's minimum, 1st percentile and share below 0.86 (`rollout/kvtier/mismatch/*`), KL and max |log ratio|.
Held-out accuracy (the evaluation's own local-chain problems, never in the train split) of the start
checkpoint and of each arm's final one, greedy, under random eviction at K and at full attention
(`kvtier eval reasoner`, in a subprocess). Writes one JSON and a plot (reward and held-out accuracy vs
step and vs wall-clock).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ARMS = ("full", "dense", "replay")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class RLBenchShape:
    steps: int = 12
    batch_size: int = 4            # prompts per step
    n: int = 4                     # GRPO group size
    response_length: int = 1160    # the longest local-chain trace is 1,122 tokens
    budget: int = 256              # K of the compressed arms
    buffer: int = 32
    lr: float = 1e-5
    kv_cache_mb: int = 24          # equal KV memory in every arm (full attention needs ~39 MB for 16 samples)
    heldout: int = 32              # held-out local-chain problems per evaluation
    rejection: str | None = None   # verl rollout_rs option for the dense arm, e.g. "seq_max_k2:0.5"
    learner_dtype: str = "bf16"    # the actor's compute dtype (rl_smoke.LEARNER_DTYPES; bf16 as in results/)
    family: str = "chains"         # the task family (kvtier.tasks.chains.FAMILIES): train split and held-out set


def arm_overrides(arm: str, shape: RLBenchShape) -> tuple[int | None, str, list[str]]:
    """(budget, learner, extra Hydra overrides) of one arm."""
    save = [f"trainer.save_freq={shape.steps}", "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"]
    if arm == "full":
        return None, "dense", save
    if arm == "dense":
        extra = []
        if shape.rejection:
            option, _, threshold = shape.rejection.partition(":")
            extra = [f"algorithm.rollout_correction.rollout_rs={option}",
                     f"algorithm.rollout_correction.rollout_rs_threshold={threshold}"]
        return shape.budget, "dense", save + extra
    if arm == "replay":
        return shape.budget, "replay", save
    raise ValueError(f"arm must be one of {ARMS}, not {arm!r}")


def heldout_accuracy(model: str, shape: RLBenchShape, out: Path) -> dict:
    """Greedy accuracy on the held-out local chains: {"evicted": {accuracy, ci}, "full": {...}, "seconds"}."""
    cmd = [sys.executable, "-m", "kvtier.cli", "eval", "reasoner", "--model", model, "--problems",
           str(shape.heldout), "--runs", "1", "--policies", "random", "--budgets", str(shape.budget), "--kinds",
           "local", "--buffer", str(shape.buffer), "--family", shape.family, "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"held-out evaluation failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    result = json.loads((out / "reasoner_eval.json").read_text())
    cells = {("full" if c["policy"] == "full" else "evicted"): {"accuracy": c["accuracy"], "ci": c["ci"]}
             for c in result["cells"] if c["kind"] == "local"}
    return {**cells, "seconds": round(time.monotonic() - t0, 1)}


def hf_checkpoint(workdir: Path, steps: int, start_model: str) -> Path:
    """The final step's Hugging Face export, with the start model's tokenizer files where verl wrote none."""
    hf = workdir / "checkpoints" / f"global_step_{steps}" / "actor" / "huggingface"
    if not (hf / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {hf}")
    for name in TOKENIZER_FILES:
        if not (hf / name).exists() and (Path(start_model) / name).exists():
            shutil.copy(Path(start_model) / name, hf / name)
    return hf


def step_row(rec: dict) -> dict:
    tails = rec.get("learner_vs_rollout") or {}
    return {"step": rec["step"], "reward_mean": rec.get("reward_mean"), "seconds": rec.get("seconds"),
            "rollout_seconds": rec.get("rollout_seconds"), "token_ratio_min": tails.get("token_ratio_min"),
            "token_ratio_p01": tails.get("token_ratio_p01"),
            "token_ratio_p05": tails.get("token_ratio_p05"), "share_below_0_86": tails.get("share_below_0_86"),
            "kl": tails.get("kl"), "max_abs_log_ratio": tails.get("max_abs_log_ratio"),
            "preemptions_mean": rec.get("preemptions_mean"), "rollout_replayable": rec.get("rollout_replayable"),
            "learner_replay_share": rec.get("learner_replay_share"),
            "advantage_abs_max": rec.get("advantage_abs_max"),
            **{k: rec.get(k) for k in ("pg_loss", "grad_norm", "ppo_kl", "clipfrac", "kl_loss", "entropy",
                                       "update_seconds")}}


def run_arm(arm: str, model: str, shape: RLBenchShape, workdir: Path, echo=print) -> dict:
    from kvtier.rollout.cpu.rl_smoke import run_smoke

    budget, learner, extra = arm_overrides(arm, shape)
    work = workdir / arm
    if work.exists():
        shutil.rmtree(work)
    t0 = time.monotonic()
    result = run_smoke(steps=shape.steps, model=model, workdir=str(work), batch_size=shape.batch_size, n=shape.n,
                       response_length=shape.response_length, budget=budget, buffer=shape.buffer,
                       kv_cache_mb=shape.kv_cache_mb, lr=shape.lr, check_tokens=0, timeout=3600, echo=echo,
                       task=shape.family, learner=learner, extra_overrides=extra, learner_dtype=shape.learner_dtype)
    if result["summary"]["returncode"] != 0:
        raise RuntimeError(f"arm {arm}: verl's trainer failed (log: {work / 'main_ppo.log'})")
    steps = [step_row(r) for r in result["steps"]]
    agreement = [s for s in steps if s["kl"] is not None]
    return {"budget": budget, "learner": learner, "train_seconds": round(time.monotonic() - t0, 1), "steps": steps,
            "logprob_agreement": {"kl": max(s["kl"] for s in agreement) if agreement else None,
                                  "max_abs_log_ratio": max(s["max_abs_log_ratio"] for s in agreement)
                                  if agreement else None},
            "checkpoint": str(hf_checkpoint(work, shape.steps, model))}


def run_rl_bench(model: str, shape: RLBenchShape, arms: list[str], workdir: Path, plot: str | None = None,
                 echo=print) -> dict:
    from kvtier.rollout.cpu.rl_smoke import check_learner_dtype
    from kvtier.tasks.chains import family as task_family

    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; choose from {ARMS}")
    check_learner_dtype(shape.learner_dtype)   # before the start checkpoint's evaluation, not after it
    task_family(shape.family)                  # ValueError naming the known families, as early
    workdir.mkdir(parents=True, exist_ok=True)
    start = heldout_accuracy(model, shape, workdir / "heldout-start")
    echo(json.dumps({"heldout_start": start}))
    report = {"budget": shape.budget, "shape": asdict(shape), "model": model, "device": "cpu", "arms": {}}
    for arm in arms:
        res = run_arm(arm, model, shape, workdir, echo)
        end = heldout_accuracy(res.pop("checkpoint"), shape, workdir / f"heldout-{arm}")
        res["heldout"] = {"start": start, "end": end}
        report["arms"][arm] = res
        echo(json.dumps({"arm": arm, "heldout_end": end, "logprob_agreement": res["logprob_agreement"]}))
    report["ratios"] = ratios(report)
    if plot:
        from .rl_plot import plot_rl

        plot_rl(report, plot)
    return report


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def ratios(report: dict) -> dict:
    """Rollout seconds per step of each compressed arm against the full-attention arm (speed-up, x)."""
    arms = report["arms"]
    full = _mean(s["rollout_seconds"] for s in arms.get("full", {}).get("steps", []))
    out = {}
    for name, arm in arms.items():
        mine = _mean(s["rollout_seconds"] for s in arm["steps"])
        if name != "full" and full and mine:
            out[f"{name}_rollout_speedup_vs_full"] = round(full / mine, 3)
    return out
