"""What each tier of a config costs in accuracy and gains in correct answers per second, read from the
newest committed `kvtier bench goodput` result for the config's model (results/goodput-*.json in a
checkout; nothing in an installed wheel, which carries no results). `kvtier serve` prints it at start-up;
the service README's tier table is rendered from it (tests/test_service_tier_report.py keeps them equal).
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "results"


def _newest(model_id: str, results: Path, pattern: str, key: str) -> tuple[Path, dict] | None:
    """(path, JSON) of the newest result matching `pattern` (by file name: the date; on one date the last
    name, so the choice never rests on the file system's listing order) that has `key` and was measured on
    `model_id` on the vLLM release `make setup` installs (versions.DEFAULT: a port's comparison run, such as
    0.32's, is reported in docs/engine.md, not as the tier's figure; a result without the field predates it)."""
    from kvtier.engine.versions import DEFAULT, minor_of

    for path in sorted(results.glob(pattern), key=lambda p: (p.name.rsplit("-cpu-", 1)[-1], p.name), reverse=True):
        data = json.loads(path.read_text())
        vllm = (data.get("machine") or {}).get("vllm") or DEFAULT       # a local build: 0.31.0+cpu
        if key in data and data.get("settings", {}).get("model_id") == model_id and minor_of(vllm) == minor_of(DEFAULT):
            return path, data
    return None


def newest_goodput(model_id: str, results: Path = RESULTS) -> tuple[Path, dict] | None:
    """The newest single-load goodput result on `model_id` (a load sweep, `loads` instead of `arms`, is not
    a tier's one figure)."""
    return _newest(model_id, results, "goodput-*.json", "arms")


def newest_load_sweep(model_id: str, results: Path = RESULTS) -> tuple[Path, dict] | None:
    """The newest load sweep (`bench goodput --concurrency 1,4,16,64`) on `model_id`."""
    return _newest(model_id, results, "goodput-load-*.json", "loads")


def sweep_lines(cfg, results: Path = RESULTS) -> dict[str, str]:
    """{tier or 'auto': one line of what the newest load sweep measured for it}: per load, correct answers/s
    against the better of stock and the sweep's fixed-budget tiers, preemptions against stock's, and the
    accuracy per kind at the lowest and highest load."""
    out: dict[str, str] = {}
    names = {t.name for t in cfg.tiers} | {"auto"}
    for model_id in cfg.model_ids:
        found = newest_load_sweep(model_id, results)
        if found is None:
            continue
        path, data = found
        loads = sorted(data["loads"], key=int)
        fixed = [t.name for t in cfg.tiers if t.compressed and not t.elastic]
        runs = len(data["loads"][loads[0]]["runs"])
        for name in data["loads"][loads[0]]["arms"]:
            if name not in names or name in fixed or name == "full":
                continue
            ratios, pre, stock_pre = [], [], []
            for c in loads:
                arms = data["loads"][c]["arms"]
                best = max(a["correct_per_s"] for n, a in arms.items() if n == "stock" or n in fixed)
                ratios.append(f"{arms[name]['correct_per_s'] / best:.2f}")
                pre.append(f"{arms[name].get('preemptions', 0):.0f}")
                stock_pre.append(f"{arms.get('stock', {}).get('preemptions', 0):.0f}")
            acc = "; ".join(f"load {c}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
                data["loads"][c]["arms"][name]["accuracy"].items())) for c in (loads[0], loads[-1]))
            out[name] = (f"loads {'/'.join(loads)}: {'/'.join(ratios)}x the better of stock and "
                         f"{'/'.join(n for n in fixed if n in data['loads'][loads[0]]['arms']) or 'nothing'} in "
                         f"correct answers/s, preemptions {'/'.join(pre)} (stock {'/'.join(stock_pre)}); "
                         f"accuracy {acc} [{path.name}, median of {runs} run(s)]")
    return out


def tier_lines(cfg, results: Path = RESULTS) -> dict[str, str]:
    """{tier or 'auto': one line of measured accuracy and goodput} for the tiers a result measured."""
    out: dict[str, str] = {}
    for model_id in cfg.model_ids:
        found = newest_goodput(model_id, results)
        if found is None:
            continue
        path, data = found
        arms = data["arms"]
        full = arms.get("full", {}).get("correct_per_s")
        kv = data["settings"].get("kv_cache_bytes")
        workload = ", ".join(x for x in (f"{kv >> 20} MiB KV" if kv else "",
                                         f"concurrency {data['concurrency']}" if data.get("concurrency") else "") if x)
        rule = data.get("routing_rule")
        for name, a in arms.items():
            acc = ", ".join(f"{k} {v:.2f}" for k, v in sorted(a["accuracy"].items()))
            if name == "auto" and rule != cfg.routing.rule:     # measured under another routing rule
                acc = f"under routing rule {rule or 'cheapest-fit'} (this config: {cfg.routing.rule}): {acc}"
            rel = f", {a['correct_per_s'] / full:.2f}x full attention's correct answers/s" if full else ""
            stock = a.get("correct_per_s_ratio_to_stock")
            out[name] = (f"accuracy {acc}{rel}" + (f" ({stock:.2f}x stock vLLM)" if stock is not None else "")
                         + f" [{path.name}{': ' + workload if workload else ''}, median of {len(data['runs'])} run(s)]")
    return out


def markdown(cfg, results: Path = RESULTS) -> str:
    """The service README's table: every tier of `cfg` (and auto), measured or not."""
    lines, across = tier_lines(cfg, results), sweep_lines(cfg, results)
    cell = lambda name: "<br>".join([*([lines[name]] if name in lines else []),  # noqa: E731
                                     *([f"across load: {across[name]}"] if name in across else [])]) or "not measured"
    rows = ["| tier | budget | measured (kvtier bench goodput) |", "| --- | --- | --- |"]
    for t in cfg.tiers:
        budget = (f"K={t.budget} r={t.buffer} {t.policy}" if t.compressed else
                  f"elastic, floor K={t.floor} r={t.buffer} {t.policy}" if t.elastic else "full attention")
        rows.append(f"| `{t.name}` | {budget} | {cell(t.name)} |")
    rows.append(f"| `auto` | kvtier's routing | {cell('auto')} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- tiers:begin -->", "<!-- tiers:end -->"
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "reasoner.yaml"


def render_into(path: Path, cfg=None, results: Path = RESULTS) -> bool:
    """Rewrite the table between the tiers markers of `path` for `cfg` (default: the demo config)."""
    from .config import load_config

    cfg = cfg or load_config(DEMO_CONFIG)
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = f"{head}{BEGIN}\n{markdown(cfg, results)}{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(f"{arg}: {'rewritten' if render_into(Path(arg)) else 'up to date'}")

