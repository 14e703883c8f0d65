"""`kvtier bench goodput-merge`: runs of `bench goodput` made one at a time (a run per session on a 2-core
machine) as one result, as if made with `--runs N`: the same settings, problems, loads and arms are
required (a difference is refused naming the field), the runs are concatenated in the order given and
the median run is chosen again (goodput.median_of). Each run keeps the commit and machine it ran on
(`run_commits`, `run_machines`), so runs of different code stay told apart.
"""

from __future__ import annotations

from .goodput import median_of

SAME = ("tasks", "max_tokens", "routing_rule", "concurrency")
SAME_SETTINGS_BUT = ("model_path",)     # where the model was read from (a worktree's path) may differ


def _runs_of(result: dict) -> int:
    part = next(iter(result["loads"].values())) if "loads" in result else result
    return len(part["runs"])


def _check_same(results: list[dict]) -> None:
    first = results[0]
    for i, other in enumerate(results[1:], 2):
        for field in SAME:
            if first.get(field) != other.get(field):
                raise ValueError(f"result {i} differs in `{field}`: {other.get(field)!r} vs {first.get(field)!r}")
        for field in set(first["settings"]) | set(other["settings"]):
            if field not in SAME_SETTINGS_BUT and first["settings"].get(field) != other["settings"].get(field):
                raise ValueError(f"result {i} differs in `settings.{field}`: {other['settings'].get(field)!r} "
                                 f"vs {first['settings'].get(field)!r}")
        if ("loads" in first) != ("loads" in other) or sorted(first.get("loads", {})) != sorted(other.get("loads", {})):
            raise ValueError(f"result {i} differs in `loads`: {sorted(other.get('loads', {}))} vs "
                             f"{sorted(first.get('loads', {}))}")


def _merge_part(parts: list[dict]) -> dict:
    arms = list(parts[0]["arms"])
    for part in parts[1:]:
        if list(part["arms"]) != arms:
            raise ValueError(f"results differ in `arms`: {list(part['arms'])} vs {arms}")
    return {**{k: v for k, v in parts[0].items() if k not in ("arms", "median_run", "median_by", "runs", "summary")},
            **median_of([run for part in parts for run in part["runs"]], arms)}


def merge(results: list[dict]) -> dict:
    """One result holding every run of `results` (single-load or load sweeps alike)."""
    if len(results) < 2:
        raise ValueError("give two or more results to merge")
    _check_same(results)
    out = {k: v for k, v in results[-1].items() if k not in ("loads", "arms", "median_run", "median_by", "runs",
                                                              "summary")}
    out["run_commits"] = [r.get("commit") for r in results for _ in range(_runs_of(r))]
    out["run_machines"] = [r.get("machine") for r in results for _ in range(_runs_of(r))]
    if "loads" in results[0]:
        out["loads"] = {load: _merge_part([r["loads"][load] for r in results]) for load in results[0]["loads"]}
    else:
        out.update(_merge_part(results))
    return out
