"""One JSON record per GRPO step of `kvtier rl smoke` (kvtier.rollout.cpu.rl_smoke), from the metrics verl's `file`
logger wrote for the step and the rl_smoke_hooks' events so far: kvtier's eviction metrics, the learner vs
sampler tails, the update's own diagnostics (verl's names), GRPO's groups with signal, seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IS_MEAN = "rollout_corr/rollout_is_mean"
KVTIER_METRICS = "rollout/kvtier/"
# where each trainer logs kvtier's eviction metrics: the v1 `kvtier_<mode>` trainers under their own name,
# verl's v0 RayPPOTrainer as step timing (`timing_s/<name>`, see kvtier.rollout.trainer_hooks)
METRIC_PREFIX = {"v1": "", "v0": "timing_s/"}


def _float(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v


def step_record(step: int, data: dict, events: list[dict], samples: int, trainer: str = "v1") -> dict:
    """One JSON line for a trainer step from its logged metrics and the hooks' events so far."""
    kv = METRIC_PREFIX[trainer] + KVTIER_METRICS
    ev_mean = _float(data.get(kv + "eviction_events/mean"))
    compressed = _float(data.get(kv + "compressed_fraction"))
    total = None
    if ev_mean is not None:
        total = int(round(ev_mean * (compressed if compressed is not None else 1.0) * samples))
    syncs = [e for e in events if e.get("event") == "update_weights"]
    version = next((e.get("global_steps") for e in reversed(syncs) if e.get("global_steps") == step), None)
    checks = [e for e in events if e.get("event") == "logprob_check" and e.get("global_steps") == step]
    mismatch = {k.removeprefix("rollout_corr/"): v for k, v in data.items()
                if k.startswith("rollout_corr/") and any(s in k for s in ("kl", "ppl", "chi2"))}
    from kvtier.rollout.metrics import learner_entries

    from kvtier.rollout.learner_replay import LEARNER_METRICS

    learner, replayable = learner_entries(data, kv.rstrip("/"))
    shares = {k.removeprefix(f"{LEARNER_METRICS}/").removesuffix("_share"): _float(v) for k, v in data.items()
              if k.startswith(f"{LEARNER_METRICS}/")}
    staleness = data.get("training/off_policy/trajectory_staleness/max")
    return {
        "step": step,
        "eviction_events": total,
        "eviction_events_mean": ev_mean,
        "tokens_evicted_mean": _float(data.get(kv + "tokens_evicted/mean")),
        "generate_calls_mean": _float(data.get(kv + "generate_calls/mean")),   # per sample: 1 single-turn
        "kvtier_metrics": sorted(k for k in data if KVTIER_METRICS in k),
        "rollout_is_mean": _float(data.get(IS_MEAN)),
        "rollout_is_max": _float(data.get("rollout_corr/rollout_is_max")),
        # verl's rollout_rs (a dense learner's sequence rejection): the share of samples it masked out
        "rejected_share": _float(data.get("rollout_corr/rollout_rs_seq_masked_fraction")),
        "mismatch": mismatch,
        # learner (old log-probs) vs sampler (rollout log-probs) per token; how many samples the rollout
        # returned with a replayable record, and what share of samples the learner's update forwards replayed
        # (empty for a dense learner: verl's own engine)
        "learner_vs_rollout": {k: _float(v) for k, v in learner.items()},
        "rollout_replayable": {k: int(v) for k, v in replayable.items()},
        "learner_replay_share": shares,
        "weights_version": version,
        "rollout_weights_staleness": staleness,
        "sleeps": sum(e.get("event") == "sleep" for e in events),
        "wakes": sum(e.get("event") == "wake" and "kv_cache" in (e.get("tags") or []) for e in events),
        "logprob_check": ({k: checks[-1].get(k) for k in ("max_abs_diff", "control_max_abs_diff", "error")
                           if checks[-1].get(k) is not None} if checks else None),
        "actor_loss": _float(data.get("actor/pg_loss")),
        # the update's own diagnostics (verl's names): under learner replay an on-policy update's forward sees
        # the deaths the old log-probs were scored with, so its ppo_kl is ~0 and nothing is clipped
        **{name: _first(data, *keys) for name, keys in UPDATE_METRICS.items()},
        "reward_mean": _float(data.get("critic/score/mean")),
        # GRPO learns only from groups whose rewards differ: 0 when every group's reward was constant
        "advantage_abs_max": max((abs(v) for v in (_float(data.get("critic/advantages/max")),
                                                  _float(data.get("critic/advantages/min"))) if v is not None),
                                 default=None),
        "groups": _float(data.get(kv + "grpo/groups")),
        "groups_with_signal": _float(data.get(kv + "grpo/groups_with_signal")),
        "preemptions_mean": _float(data.get(kv + "preemptions/mean")),
        "seconds": _float(data.get("timing_s/step")),
        "rollout_seconds": _float(data.get("timing_s/gen")),
    }


UPDATE_METRICS = {   # step record field -> verl metric names (v1 and v0 trainers, engine and legacy workers)
    "pg_loss": ("actor/pg_loss",), "grad_norm": ("actor/grad_norm",), "ppo_kl": ("actor/ppo_kl",),
    "clipfrac": ("actor/pg_clipfrac",), "kl_loss": ("actor/kl_loss", "kl_loss"), "entropy": ("actor/entropy",),
    "update_seconds": ("timing_s/update_actor",),
}


def _first(data: dict, *keys: str) -> float | None:
    return next((_float(data[k]) for k in keys if k in data), None)


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out
