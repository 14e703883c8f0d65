"""Held-out accuracy for `kvtier bench rl`: a checkpoint's greedy accuracy on the evaluation's own local-chain
problems (never in the train split) under random eviction at the bench's K and at full attention, per problem;
and the pooled accuracy over seeds (problems resampled, a problem's seeds moving together)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The evaluation engine's dtype, the same on every machine: a series resumed on another CPU (native or emulated
# bf16) evaluates alike; every committed series ran it (eval reasoner's own default, auto, would pick float32
# on a CPU without native bf16).
HELDOUT_DTYPE = "bfloat16"


def heldout_accuracy(model: str, shape, out: Path) -> dict:
    """`shape`: the bench's RLBenchShape (heldout, budget, buffer, family). Greedy accuracy on the held-out local chains: {"evicted": {accuracy, ci}, "full": {...}, "seconds"}."""
    cmd = [sys.executable, "-m", "kvtier.cli", "eval", "reasoner", "--model", model, "--problems",
           str(shape.heldout), "--runs", "1", "--policies", "random", "--budgets", str(shape.budget), "--kinds",
           "local", "--buffer", str(shape.buffer), "--family", shape.family, "--dtype", HELDOUT_DTYPE, "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"held-out evaluation failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    result = json.loads((out / "reasoner_eval.json").read_text())
    cells = {("full" if c["policy"] == "full" else "evicted"): {"accuracy": c["accuracy"], "ci": c["ci"]}
             for c in result["cells"] if c["kind"] == "local"}
    for line in (out / "instances.jsonl").read_text().splitlines():   # per problem, for the pooled CI
        row = json.loads(line)
        if row["task"] == "local":
            cond = cells["full" if row["policy"] == "full" else "evicted"]
            cond.setdefault("problems", {})[row["pid"]] = bool(row["correct"])
    return {**cells, "seconds": round(time.monotonic() - t0, 1)}


def pooled_heldout(ends: list[dict], start: dict | None = None) -> dict:
    """Held-out accuracy pooled over seeds: each problem's mean over the seeds' final checkpoints, 95%
    bootstrap CI with problems resampled (kvtier.evaluation.reasoner_eval.accuracy_ci). With the `start`
    evaluation: `change` = end - start, paired by problem (kvtier.evaluation.stats.paired_bootstrap: the
    issue's "+0.15 over its start, CI excludes 0")."""
    from kvtier.evaluation.reasoner_eval import accuracy_ci
    from kvtier.evaluation.stats import paired_bootstrap

    out = {}
    for cond in ("evicted", "full"):
        rows = [{"pid": pid, "correct": ok} for end in ends for pid, ok in (end.get(cond) or {}).get("problems",
                                                                                                      {}).items()]
        if rows:
            out[cond] = {"accuracy": round(sum(r["correct"] for r in rows) / len(rows), 4),
                         "ci": [round(x, 4) for x in accuracy_ci(rows)], "n": len(rows), "seeds": len(ends)}
            before = ((start or {}).get(cond) or {}).get("problems")
            if before:
                after: dict = {}
                for r in rows:
                    after.setdefault(r["pid"], []).append(float(r["correct"]))
                d = paired_bootstrap(after, {pid: [float(ok)] for pid, ok in before.items()})
                out[cond]["change"] = {"diff": round(d["diff"], 4), "ci": [round(d["lo"], 4), round(d["hi"], 4)]}
    return out


def supervised_read(model: str, shape, workdir: Path, start: dict, where: dict) -> dict:
    """A supervised model beside the arms (issue #59 item 5: the start's eviction fine-tune, e.g. reasoner-long):
    its held-out read on the arms' problems at the arms' K (kept in `workdir` like the start's, reused when the
    settings match), its change from the start paired by problem, and its training cost from its TRAINING.json
    (steps, sequences, wall seconds and the device they ran on: another machine's seconds, said so)."""
    from .rl_store import keep, reuse

    key, kept = {**shape.start_key(), "model": model}, workdir / "heldout-supervised.json"
    read = reuse(kept, key)
    if read is None:
        read = {**heldout_accuracy(model, shape, workdir / "heldout-supervised"), "environment": where}
        keep(kept, key, read)
    meta = Path(model) / "TRAINING.json"
    training = json.loads(meta.read_text()) if meta.exists() else {}
    return {"model": model, "heldout": pooled_heldout([read], start), "read_environment": read.get("environment"),
            "training": {k: training.get(k) for k in ("command", "steps", "sequences", "wall_seconds", "devices")}}
