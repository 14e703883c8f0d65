"""The plot of a `kvtier bench serve` result (serve.py): per workload, each arm's tok/s and TTFT."""

from __future__ import annotations

from pathlib import Path


def _bars(ax, arms: dict, key: str, ratio_key: str, fmt: str) -> None:
    """One panel: per arm the median over runs of `key`, error bars min-max, the ratio to stock on top."""
    labels = list(arms)
    med = [arms[a][key] for a in labels]
    lo = [m - min(r[key] for r in arms[a]["runs"]) for a, m in zip(labels, med)]
    hi = [max(r[key] for r in arms[a]["runs"]) - m for a, m in zip(labels, med)]
    bars = ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=["#888", "#aaa", "#4a90d9", "#2e7d32"][:len(labels)])
    for bar, a in zip(bars, labels):
        ratio = arms[a].get(ratio_key)
        if ratio is not None:
            ax.annotate(fmt.format(ratio), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)


def plot(result: dict, path: Path) -> None:
    """Per workload: output tok/s (top) and mean TTFT (bottom), each arm's median over runs with its
    min-max, ratios to stock on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), squeeze=False)
    for col, wname in enumerate(names):
        arms = result["workloads"][wname]["arms"]
        _bars(axes[0][col], arms, "tok_per_s", "ratio_to_stock", "{:.2f}x")
        _bars(axes[1][col], arms, "ttft_ms", "ttft_ratio_to_stock", "{:.2f}x")
        spec = result["workloads_spec"][wname]
        axes[0][col].set_title(f"{wname}: {spec['prompts']} x ({spec['input_len']}+{spec['output_len']}) tok, "
                               f"concurrency {spec['concurrency']}", fontsize=9)
        axes[0][col].set_ylabel("output tok/s")
        axes[1][col].set_ylabel("mean TTFT (ms)")
    fig.suptitle(f"kvtier bench serve ({result['runs']} runs: median, bars min-max; ratios to stock; max_num_seqs "
                 f"{result['settings']['max_num_seqs']}, KV {result['settings']['kv_cache_bytes'] >> 20} MiB)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
