"""The tables of a `kvtier bench rl` report (docs/rl.md prints them): per arm, pooled over seeds, and per seed.

Per arm: reward early and late (the mean over seeds of the first and last three steps), held-out accuracy
under eviction and at full attention at the end with its CI and its change from the start (paired by problem),
rollout seconds per step and the speed-up over the full arm, the learner-vs-sampler KL, the share of samples
verl's rejection masked. Per seed: the same held-out numbers for each run, so a pooled number is never
read without the runs behind it.
"""

from __future__ import annotations

import math

from .rl_plot import arm_runs


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]          # a NaN step shows as nan in the tables
    return sum(xs) / len(xs) if xs else None


def _finite_mean(xs) -> float | None:
    return _mean(x for x in xs if x is None or math.isfinite(x))


def ratios(report: dict) -> dict:
    """Rollout seconds per step of each compressed arm against the full-attention arm (speed-up, x), and its 95%
    bootstrap interval where both arms have steps (`speedup_ci`). The point estimate is over the seeds both arms
    ran, as the interval is (a series in progress has seeds one arm has not run yet); over all seeds where
    they share none."""
    arms = report["arms"]
    full_runs = _rollout_seconds(arms.get("full", {}))
    out = {}
    for name, arm in arms.items():
        if name == "full" or not full_runs:
            continue
        runs = _rollout_seconds(arm)
        seeds = (set(full_runs) & set(runs)) or set(full_runs) | set(runs)
        full = _mean(x for s in seeds for x in full_runs.get(s, []))
        mine = _mean(x for s in seeds for x in runs.get(s, []))
        if full and mine:
            out[f"{name}_rollout_speedup_vs_full"] = round(full / mine, 3)
            out[f"{name}_rollout_speedup_vs_full_ci"] = speedup_ci(arms["full"], arm)
            out[f"{name}_rollout_speedup_vs_full_per_seed"] = seed_speedups(arms["full"], arm)
    return out


def _rollout_seconds(arm: dict) -> dict[int, list[float]]:
    """{seed: its finite rollout seconds per step}, for the seeds that have any (the seeds a pairing can use)."""
    runs = {r.get("seed", i): [s["rollout_seconds"] for s in r.get("steps", []) if s.get("rollout_seconds") is not None
                               and math.isfinite(s["rollout_seconds"])] for i, r in enumerate(arm_runs(arm))}
    return {s: xs for s, xs in runs.items() if xs}


def speedup_ci(full: dict, arm: dict, draws: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of full's mean rollout seconds per step over `arm`'s. The seeds both arms ran are
    resampled jointly (a seed is a pair: the same prompts in both arms), then steps within each drawn seed and arm
    (a hierarchical bootstrap; with 3 seeds the seed level alone has 10 distinct draws). Without a common seed,
    each arm's seeds are resampled on their own."""
    import random

    rng = random.Random(seed)
    a, b = _rollout_seconds(full), _rollout_seconds(arm)
    common = sorted(set(a) & set(b))

    def mean_of(runs: dict[int, list[float]], seeds: list[int]) -> float:
        xs = [x for s in seeds for x in (rng.choice(runs[s]) for _ in runs[s])]
        return sum(xs) / len(xs)

    stats = []
    for _ in range(draws):
        if common:
            seeds = [rng.choice(common) for _ in common]
            stats.append(mean_of(a, seeds) / mean_of(b, seeds))
        else:
            stats.append(mean_of(a, [rng.choice(list(a)) for _ in a]) / mean_of(b, [rng.choice(list(b)) for _ in b]))
    stats.sort()
    return [round(stats[int(0.025 * draws)], 3), round(stats[int(0.975 * draws) - 1], 3)]


def seed_speedups(full: dict, arm: dict) -> dict[int, float]:
    """Full's mean rollout seconds per step over `arm`'s, per seed both arms ran."""
    a, b = _rollout_seconds(full), _rollout_seconds(arm)
    return {s: round((sum(a[s]) / len(a[s])) / (sum(b[s]) / len(b[s])), 3) for s in sorted(set(a) & set(b))}


def _f(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _acc(cell: dict | None) -> str:
    if not cell:
        return "–"
    lo, hi = cell["ci"]
    return f"{cell['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"


def _change(cell: dict | None) -> str:
    change = (cell or {}).get("change")
    if not change:
        return "–"
    lo, hi = change["ci"]
    return f"{change['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def _window(runs: list[dict], first: bool, width: int = 3) -> float | None:
    per_run = []
    for run in runs:
        steps = sorted(run["steps"], key=lambda s: s["step"])
        part = steps[:width] if first else steps[-width:]
        per_run.append(_mean(s["reward_mean"] for s in part))
    return _mean(per_run)


def exact_share(runs: list[dict]) -> float | None:
    """The share of an arm's samples the learner scored as they were sampled, per step from the rollout's counts
    (`rollout/kvtier/replayable/*`): with a replay learner (the step has `learner_replay_share`) the learner's
    own replayed (by segment included) and full shares; with a dense learner only the full-attention samples (a
    compressed sample it scores at full attention is not what was sampled, whatever its record allowed). None
    where no step recorded the counts."""
    exact = total = 0.0
    for s in (s for r in runs for s in r["steps"]):
        counts = s.get("rollout_replayable") or {}
        n = sum(counts.values())
        shares = s.get("learner_replay_share") or {}
        exact += n * (shares.get("replayed", 0) + shares.get("full", 0)) if shares else counts.get("full", 0)
        total += n
    return exact / total if total else None


def arm_table(report: dict) -> str:
    """One row per arm, pooled over its seeds."""
    arms = report["arms"]
    speedups = ratios(report)                     # the point estimate and interval pair the same seeds
    head = ("| arm | seeds | reward, first 3 → last 3 steps | held-out evicted: end [CI] | change vs start [CI] | "
            "held-out full: end [CI] | change vs start [CI] | rollout s / step (× full) | learner vs rollout KL "
            "(max) | samples rejected | scored exactly (replayed or full) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, arm in arms.items():
        runs = arm_runs(arm)
        end = arm["heldout"]["end"]
        rollout = _finite_mean(s["rollout_seconds"] for r in runs for s in r["steps"])
        x, ci = (speedups.get(f"{name}_rollout_speedup_vs_full{k}") for k in ("", "_ci"))
        speed = (f" ({x:.2f}×" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") + ")") if x else ""
        kl = max((s["kl"] for r in runs for s in r["steps"] if s.get("kl") is not None), default=None)
        rejected = _mean(s.get("rejected_share") for r in runs for s in r["steps"])
        exact = exact_share(runs)
        lines.append(f"| {name} | {len(runs)} | {_f(_window(runs, True))} → {_f(_window(runs, False))} | "
                     f"{_acc(end.get('evicted'))} | {_change(end.get('evicted'))} | {_acc(end.get('full'))} | "
                     f"{_change(end.get('full'))} | {_f(rollout, 1)}{speed} | "
                     f"{'–' if kl is None else f'{kl:.1e}'} | {_f(rejected)} | {_f(exact)} |")
    return "\n".join(lines)


def seed_table(report: dict) -> str:
    """One row per run: held-out accuracy at its end, evicted and full, and its mean reward."""
    lines = ["| arm | seed | mean reward | held-out evicted: end | held-out full: end | train s |",
             "|---|---|---|---|---|---|"]
    for name, arm in report["arms"].items():
        for run in arm_runs(arm):
            end = run.get("heldout", {}).get("end", {})
            lines.append(f"| {name} | {run.get('seed', 0)} | {_f(_mean(s['reward_mean'] for s in run['steps']))} | "
                         f"{_acc(end.get('evicted'))} | {_acc(end.get('full'))} | {_f(run.get('train_seconds'), 0)} |")
    return "\n".join(lines)


def start_line(report: dict) -> str:
    start = report.get("heldout_start") or next(iter(report["arms"].values()))["heldout"]["start"]
    line = (f"start: held-out evicted (K = {report['budget']}) {_acc(start.get('evicted'))}, "
            f"full {_acc(start.get('full'))}")
    missing = report.get("missing")
    return line + (f"; not yet run: {', '.join(missing)}" if missing else "")


def supervised_line(report: dict) -> str:
    """The supervised anchor beside the arms (issue #59 item 5): its held-out read on the same problems, its
    change from the start (paired by problem) and what its training cost; empty when the report has none."""
    sup = report.get("supervised")
    if not sup:
        return ""
    held, train = sup["heldout"], sup.get("training") or {}
    cost = (f"{train['steps']} steps, {train['sequences']} sequences, {train['wall_seconds']:.0f} s wall"
            f" ({'; '.join(d.get('device', '') for d in train.get('devices') or [])})"
            if train.get("wall_seconds") is not None else "cost not recorded")
    return (f"supervised anchor {sup['model']}: held-out evicted {_acc(held.get('evicted'))} (vs start "
            f"{_change(held.get('evicted'))}), full {_acc(held.get('full'))} (vs start {_change(held.get('full'))}); "
            f"training: {cost}")
