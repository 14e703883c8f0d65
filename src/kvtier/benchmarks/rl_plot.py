"""The plot of `kvtier bench rl`: reward vs step and vs wall-clock, held-out accuracy at the start and end of
each arm (under eviction at K and at full attention, 95% CI), the learner/sampler ratio's lower tail, and
every per-step diagnostic of issue #38: groups with signal, policy loss, grad norm, ppo_kl with the clip
fraction, KL loss, entropy, rollout and update seconds. One colour per arm in every panel."""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

COLORS = {"full": "tab:gray", "dense": "tab:red", "replay": "tab:blue", "replay-fullref": "tab:purple",
          "replay-share": "tab:olive", "replay-anchor": "tab:green", "vllm": "tab:brown",
          "dense-rs": "tab:orange"}


def arm_runs(arm: dict) -> list[dict]:
    """An arm's runs: its `seeds` (one run per seed), or the arm itself in reports from before seeds."""
    return arm.get("seeds") or [arm]


def plot_rl(report: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(6, 2, figsize=(11, 21))
    for name, arm in report["arms"].items():
        c = COLORS.get(name)
        runs = arm_runs(arm)
        many = len(runs) > 1
        for i, run in enumerate(runs):          # one line per seed, the arm's colour (thin beside the seeds' mean)
            _plot_run(ax, run["steps"], c, None if i else name, alpha=0.35 if many else 1.0,
                      label_reward=not many)
        if many:                                # the mean over the seeds that logged a reward at each step
            by_step: dict[int, list[float]] = {}
            for r in runs:
                for s in r["steps"]:
                    if s["reward_mean"] is not None:
                        by_step.setdefault(s["step"], []).append(s["reward_mean"])
            steps = sorted(by_step)
            ax[0, 0].plot(steps, [sum(by_step[k]) / len(by_step[k]) for k in steps], "-", color=c, lw=2.5,
                          label=f"{name} (mean of {len(runs)} seeds)")
    ax[0, 0].set(xlabel="GRPO step", ylabel="mean reward (graded)", title="reward vs step")
    ax[0, 1].set(xlabel="wall-clock (min)", ylabel="mean reward", title="reward vs wall-clock (one line per seed)")
    ax[1, 1].axhline(0.86, color="k", lw=0.8, ls=":")
    ax[1, 1].set(xlabel="GRPO step", ylabel="pi_learner / pi_rollout", yscale="log",
                 title="per-token ratio: 1st percentile (o-) and min (x--)")
    for (i, j), (_, ylabel, title) in PANELS.items():
        ax[i, j].set(xlabel="GRPO step", ylabel=ylabel, title=title)
    _heldout(ax[1, 0], report)
    for a in ax.flat:
        a.grid(alpha=0.3)
    # one colour per arm in every panel: the arms' legend once, the held-out panel's conditions in its own
    ax[0, 0].legend(fontsize=7)
    ax[1, 0].legend(fontsize=7)
    fig.suptitle(f"GRPO on kvtier rollouts, random K={report['budget']} (CPU, reasoner, local chains)")
    fig.tight_layout(rect=(0, 0, 1, 0.985))   # room for the suptitle
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# (row, column) -> (step keys, one per line style, y label, title)
PANELS = {(2, 0): (("groups_with_signal",), "groups", "groups with differing rewards (GRPO's signal)"),
          (2, 1): (("pg_loss",), "policy loss", "update: policy loss"),
          (3, 0): (("grad_norm",), "grad norm (before clipping)", "update: grad norm"),
          (3, 1): (("ppo_kl", "clipfrac"), "ppo_kl (o-), clip fraction (x--)", "update: ppo_kl and clip fraction"),
          (4, 0): (("kl_loss",), "KL loss", "update: KL loss to the reference"),
          (4, 1): (("entropy",), "entropy", "update: entropy of the trained policy"),
          (5, 0): (("rollout_seconds",), "seconds", "rollout seconds per step"),
          (5, 1): (("update_seconds",), "seconds", "update seconds per step")}


def _plot_run(ax, steps: list[dict], c, name: str | None, alpha: float = 1.0, label_reward: bool = True) -> None:
    xs = [s["step"] for s in steps]
    reward = [s["reward_mean"] for s in steps]
    clock = [v / 60 for v in accumulate(s["seconds"] or 0.0 for s in steps)]
    series = lambda key: [s.get(key) if s.get(key) is not None else float("nan") for s in steps]  # noqa: E731
    ax[0, 0].plot(xs, reward, "o-", color=c, label=name if label_reward else None, alpha=alpha, ms=3)
    ax[0, 1].plot(clock, reward, "o-", color=c, alpha=alpha, ms=3)
    ax[1, 1].plot(xs, series("token_ratio_p01"), "o-", color=c)
    ax[1, 1].plot(xs, series("token_ratio_min"), "x--", color=c, alpha=0.6)
    for (i, j), (keys, _, _) in PANELS.items():
        for key, style in zip(keys, ("o-", "x--")):
            ax[i, j].plot(xs, series(key), style, color=c, alpha=max(alpha, 0.6), ms=3)


def _heldout(ax, report: dict) -> None:
    arms = list(report["arms"])
    start = next(iter(report["arms"].values()))["heldout"]["start"] if arms else {}
    bars = [("start", start)] + [(a, report["arms"][a]["heldout"]["end"]) for a in arms]
    for i, (label, res) in enumerate(bars):
        for j, (cond, hatch) in enumerate((("evicted", ""), ("full", "//"))):
            cell = res.get(cond)
            if not cell:
                continue
            lo, hi = cell["ci"]
            x = i + (j - 0.5) * 0.38
            ax.bar(x, cell["accuracy"], 0.36, color=COLORS.get(label, "white"), hatch=hatch, alpha=0.8, edgecolor="k",
                   label=f"{cond}" if i == 0 else None)
            ax.errorbar(x, cell["accuracy"], yerr=[[cell["accuracy"] - lo], [hi - cell["accuracy"]]], color="k",
                        capsize=3)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right")
    ax.set(ylim=(0, 1.05), ylabel="held-out accuracy (greedy)",
           title=f"held-out local chains: random K={report['budget']} (plain) / full (hatched)")
