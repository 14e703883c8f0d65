"""Accuracy vs KV budget for `kvtier eval reasoner` (the paper's Figure 2 shape): one panel per problem
kind, one line per method (a policy with its parameters) over K (95% bootstrap CI as error bars), full
attention as a band."""

from __future__ import annotations

from pathlib import Path

STYLE = {"random": ("tab:red", "o"), "snapkv": ("tab:blue", "s"), "rkv": ("tab:green", "^"),
         "h2o": ("tab:purple", "D"), "streaming": ("tab:orange", "v")}
# lines without a style of their own (variants: random_reserve(reserve=0.1)), in order of appearance
EXTRA = [("tab:brown", "P"), ("tab:pink", "X"), ("tab:olive", "*"), ("tab:cyan", "p"), ("tab:gray", "h"),
         ("gold", "d"), ("navy", ">"), ("teal", "<")]


def plot_accuracy_vs_budget(result: dict, path: str | Path) -> Path:
    """result: the dict `run_reasoner_eval` returns (its `cells`); writes a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({c["kind"] for c in result["cells"]})
    name = lambda c: c.get("method", c["policy"])   # noqa: E731  results written before cells had a method
    extra = [m for m in dict.fromkeys(map(name, result["cells"])) if m != "full" and m not in STYLE]
    style = {**STYLE, **{m: EXTRA[i % len(EXTRA)] for i, m in enumerate(extra)}}
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds), 4), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        cells = [c for c in result["cells"] if c["kind"] == kind]
        budgets = sorted({c["budget"] for c in cells if c["budget"] is not None})
        full = next((c for c in cells if c["policy"] == "full"), None)
        if full is not None:
            ax.axhline(full["accuracy"], color="black", lw=1.5, label="full attention")
            ax.axhspan(full["ci"][0], full["ci"][1], color="black", alpha=0.08)
        for pol in dict.fromkeys(name(c) for c in cells if c["policy"] != "full"):
            pts = sorted((c["budget"], c["accuracy"], c["ci"]) for c in cells if name(c) == pol)
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            err = [[y - p[2][0] for y, p in zip(ys, pts)], [p[2][1] - y for y, p in zip(ys, pts)]]
            color, marker = style[pol]
            ax.errorbar(xs, ys, yerr=err, color=color, marker=marker, capsize=3, label=pol)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("KV budget K per head")
        ax.set_title({"local": "local chains", "needle": "needle in the trace"}.get(kind, kind))
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (\\boxed{} answer)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    cfg = result.get("config", {})
    fig.suptitle(f"kvtier reasoner: accuracy vs budget (r={cfg.get('buffer')}, "
                 f"{cfg.get('problems')} problems x {cfg.get('runs')} runs per cell)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_key_line(results: dict[str, dict], path: str | Path) -> Path:
    """The key-line probe (Figure 3a's shape): needle retrieval (95% CI) against the share of each layer's KV
    heads that keep the key line, one line per model. results: label -> `run_key_line_probe`'s dict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, res) in enumerate(results.items()):
        H = res["num_kv_heads"]
        conds = res["conditions"]
        xs = [c["heads_keeping_key"] / H for c in conds]
        ys = [c["retrieval"] for c in conds]
        err = [[y - c["retrieval_ci"][0] for y, c in zip(ys, conds)], [c["retrieval_ci"][1] - y for y, c in zip(ys, conds)]]
        color, marker = EXTRA[i % len(EXTRA)]
        ax.errorbar(xs, ys, yerr=err, color=color, marker=marker, capsize=3, label=f"{label} ({H} KV heads)")
        for x, y, c in zip(xs, ys, conds):
            ax.annotate(str(c["heads_keeping_key"]), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7,
                        color=color)
    first = next(iter(results.values()))
    ax.set(xlabel="share of each layer's KV heads that keep the key line (annotated: heads)",
           ylabel="needle retrieval (teacher-forced)", ylim=(-0.03, 1.03),
           title=f"key-line probe: random K = {first['budget']}, {first['instances']} needles of {first['family']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
