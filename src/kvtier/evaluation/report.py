"""Tables from per-instance results: Table 1 (accuracy, significance marks), Table 7 (mean generated
tokens), Table 8 (run-to-run standard deviation), and every policy-vs-policy comparison.

Columns are (task, K); a method's row is its policy and protection rule (``full`` fills every column of
its task). Marks in Table 1 compare each method with the reference method (``--reference``, default
``random``) in the same column, by the paired problem-clustered bootstrap and the sign test
(kvtier.evaluation.stats): ``▼`` significantly below the reference (the paper greys these), ``▲``
significantly above; **bold** is the best eviction method of the column. A cell with skipped instances
(the prompt did not fit the budget) is marked ``†`` and is not compared.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from .stats import compare, run_std


def _columns(instances: Sequence[dict]) -> list[tuple[str, int | None]]:
    cols = sorted({(r["task"], r["budget"]) for r in instances if r["policy"] != "full"},
                  key=lambda c: (c[0], c[1]))
    tasks_with_budgets = {t for t, _ in cols}
    for t in sorted({r["task"] for r in instances}):
        if t not in tasks_with_budgets:
            cols.append((t, None))                       # a full-only run
    return cols


def _methods(instances: Sequence[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in instances:
        seen.setdefault(r["method"], None)
    ms = list(seen)
    return (["full"] if "full" in ms else []) + [m for m in ms if m != "full"]


def _cell_instances(instances, task, budget, method):
    return [r for r in instances if r["task"] == task and r["method"] == method
            and (method == "full" or r["budget"] == budget)]


def cell_summary(rows: Sequence[dict]) -> dict:
    done = [r for r in rows if r.get("correct") is not None]
    skipped = len(rows) - len(done)
    if not done:
        return {"n": 0, "skipped": skipped}
    runs = defaultdict(list)
    for r in done:
        runs[r["run"]].append(1.0 if r["correct"] else 0.0)
    per_run = [float(np.mean(v)) for _, v in sorted(runs.items())]
    return {
        "n": len(done), "skipped": skipped, "problems": len({r["pid"] for r in done}), "runs": len(per_run),
        "accuracy": float(np.mean([1.0 if r["correct"] else 0.0 for r in done])),
        "mean_generated_tokens": float(np.mean([r["generated_tokens"] for r in done])),
        "per_run_accuracy": per_run,
        "run_std_points": 100.0 * run_std(per_run),
        "finished_by_stop": float(np.mean([r.get("finish_reason") == "stop" for r in done])),
    }


def _scores(rows: Sequence[dict]) -> dict:
    out = defaultdict(list)
    for r in rows:
        if r.get("correct") is not None:
            out[r["pid"]].append(1.0 if r["correct"] else 0.0)
    return dict(out)


def summarize(instances: Sequence[dict], *, reference: str = "random", n_boot: int = 4000, alpha: float = 0.05,
              seed: int = 0) -> dict:
    cols = _columns(instances)
    methods = _methods(instances)
    cells, pairs = {}, []
    for task, budget in cols:
        col = f"{task}@K={budget}" if budget is not None else task
        scores = {}
        for m in methods:
            rows = _cell_instances(instances, task, budget, m)
            if not rows:
                continue
            s = cell_summary(rows)
            cells[(col, m)] = s
            if s["n"] and not s["skipped"]:
                scores[m] = _scores(rows)
        names = list(scores)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                c = compare(scores[a], scores[b], name_a=a, name_b=b, n_boot=n_boot, alpha=alpha, seed=seed)
                pairs.append({"column": col, **c.to_dict()})
        if reference in scores:
            for m in names:
                if m == reference:
                    continue
                c = compare(scores[m], scores[reference], name_a=m, name_b=reference, n_boot=n_boot, alpha=alpha,
                            seed=seed)
                cells[(col, m)]["vs_reference"] = c.to_dict()
    columns = [f"{t}@K={b}" if b is not None else t for t, b in cols]
    return {"columns": columns, "methods": methods, "reference": reference, "alpha": alpha, "n_boot": n_boot,
            "cells": {f"{c}|{m}": v for (c, m), v in cells.items()}, "pairwise": pairs}


def _table(summary: dict, value, title: str, note: str = "") -> str:
    cols, methods = summary["columns"], summary["methods"]
    lines = [f"### {title}", ""]
    if note:
        lines += [note, ""]
    lines.append("| method | " + " | ".join(cols) + " |")
    lines.append("| --- |" + " --- |" * len(cols))
    for m in methods:
        row = []
        for c in cols:
            cell = summary["cells"].get(f"{c}|{m}")
            row.append("–" if cell is None or not cell.get("n") else value(c, m, cell))
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def table1(summary: dict) -> str:
    best = {}
    for c in summary["columns"]:
        accs = [(summary["cells"][f"{c}|{m}"]["accuracy"], m) for m in summary["methods"]
                if m != "full" and summary["cells"].get(f"{c}|{m}", {}).get("n")]
        if accs:
            best[c] = max(accs)[0]

    def fmt(c, m, cell):
        s = f"{cell['accuracy']:.3f}"
        if m != "full" and best.get(c) is not None and cell["accuracy"] == best[c]:
            s = f"**{s}**"
        vs = cell.get("vs_reference")
        if vs and vs["significant"]:
            s += " ▼" if vs["direction"] < 0 else " ▲"
        if cell.get("skipped"):
            s += " †"
        return s

    note = (f"Accuracy (mean over problems and runs). ▼/▲: significantly below/above `{summary['reference']}` "
            f"(paired problem-clustered bootstrap {int(100 * (1 - summary['alpha']))}% CI excludes 0 and exact sign "
            f"test p < {summary['alpha']}); bold: best eviction method per column; †: incomplete cell.")
    return _table(summary, fmt, "Table 1: accuracy under KV cache eviction", note)


def table7(summary: dict) -> str:
    return _table(summary, lambda c, m, cell: f"{cell['mean_generated_tokens'] / 1000:.2f}k",
                  "Table 7: mean generated tokens (thousands) per cell")


def table8(summary: dict) -> str:
    return _table(summary, lambda c, m, cell: f"{cell['run_std_points']:.1f}",
                  "Table 8: run-to-run standard deviation of per-run accuracy (points)")


def pairwise_table(summary: dict) -> str:
    lines = ["### Every policy-vs-policy comparison", "",
             "diff = accuracy A − B (points) with its 95% bootstrap CI; sign test: #A better / #B better / ties "
             "(problems); * significant.", "",
             "| column | A | B | diff | 95% CI | sign +/−/= | p | sig |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in summary["pairwise"]:
        lines.append(f"| {p['column']} | {p['a']} | {p['b']} | {100 * p['diff']:+.1f} | "
                     f"[{100 * p['lo']:+.1f}, {100 * p['hi']:+.1f}] | {p['n_pos']}/{p['n_neg']}/{p['n_ties']} | "
                     f"{p['p_sign']:.3g} | {'*' if p['significant'] else ''} |")
    return "\n".join(lines) + "\n"


def write_reports(instances: Sequence[dict], out_dir: str | Path, **kw) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(instances, **kw)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = "\n".join([table1(summary), table7(summary), table8(summary), pairwise_table(summary)])
    (out_dir / "report.md").write_text(md)
    return summary
