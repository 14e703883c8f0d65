"""`kvtier bench goodput --concurrency 1,4,16,64`: every arm at every load (issue #37 item 4).

One `run_goodput` per load (its own servers, the same problems, the same pool); the JSON keeps each load's
result as `bench goodput` writes it, under `loads`, plus what the plot reads. The plot has correct answers
per second against load, one line per arm, and accuracy per kind with its 95% CI at each load.
"""

from __future__ import annotations

from pathlib import Path

from .goodput import run_goodput

PER_LOAD_DROP = ("machine", "commit", "settings", "tasks", "max_tokens", "routing_rule")


def run_goodput_loads(settings, config: dict, tasks, arms: list[str], runs: int, workdir: Path, loads: list[int],
                      max_tokens: int, seed: int = 0, log=print, family: str | None = None,
                      client_nice: int | None = None) -> dict:
    """{"loads": {"<concurrency>": {"arms": {...}, "runs": [...], ...}}, settings, tasks, machine, commit}."""
    out: dict = {"loads": {}}
    for load in loads:
        log(f"load {load}: {len(tasks)} problems at concurrency {load}")
        res = run_goodput(settings, config, tasks, arms, runs, workdir / f"c{load}", load, max_tokens, seed, log,
                          family, client_nice)
        for key in PER_LOAD_DROP:
            if key in res and key not in out:
                out[key] = res[key]
        out["loads"][str(load)] = {k: v for k, v in res.items() if k not in PER_LOAD_DROP}
    return out


def plot_loads(result: dict, path: Path) -> None:
    """Left: correct answers per second against load, one line per arm (median run). Right: accuracy per
    kind with its 95% CI at each load (one panel row, a marker per kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(result["loads"], key=int)
    arms = list(result["loads"][loads[0]]["arms"])
    kinds = sorted({k for a in result["loads"][loads[0]]["arms"].values() for k in a["accuracy"]})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = [int(c) for c in loads]
    for i, arm in enumerate(arms):
        ys = [result["loads"][c]["arms"][arm]["correct_per_s"] for c in loads]
        left.plot(x, ys, marker="o", label=arm, color=f"C{i}")
        for j, kind in enumerate(kinds):
            acc = [result["loads"][c]["arms"][arm]["accuracy"].get(kind) for c in loads]
            ci = [result["loads"][c]["arms"][arm]["ci"][kind]["accuracy"] for c in loads]
            off = [v * (1 + 0.04 * (i - len(arms) / 2)) for v in x]          # arms side by side at each load
            right.errorbar(off, acc, yerr=[[a - lo for a, (lo, _) in zip(acc, ci)], [hi - a for a, (_, hi) in zip(acc, ci)]],
                           fmt="os"[j % 2], color=f"C{i}", capsize=2, ms=4, alpha=0.9,
                           label=f"{arm} {kind}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("requests in flight (concurrency)")
    left.set_ylabel("correct answers per second (median run)")
    left.legend(fontsize=8)
    right.set_ylabel("accuracy (o: %s, s: %s), 95%% CI" % tuple((kinds + ["", ""])[:2]))
    right.set_ylim(-0.05, 1.05)
    s, n = result["settings"], len(next(iter(result["loads"].values()))["runs"])
    fig.suptitle(f"kvtier bench goodput across load: {result['tasks']['problems']} problems, KV "
                 f"{s['kv_cache_bytes'] >> 20} MiB, {s.get('dtype')}, {n} run(s) per load", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
