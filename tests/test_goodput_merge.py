"""benchmarks/goodput_merge.py: runs of `bench goodput` made one at a time become one result as `--runs N`
would have made it (median run chosen again, each run's commit kept); results that differ in what they
measured are refused naming the field. Synthetic results: no servers."""

import json

import pytest
from typer.testing import CliRunner

from kvtier.benchmarks.goodput_merge import merge

SETTINGS = {"model_path": "/a/reasoner", "model_id": "kvtier-reasoner", "kv_cache_bytes": 16 << 20, "dtype": "float32"}


def _arms(ratio):
    arm = lambda r: {"correct_per_s": r, "correct_per_s_ratio_to_stock": r, "accuracy": {"local": 1.0},  # noqa: E731
                     "ci": {"local": {"accuracy": [0.9, 1.0]}}}
    return {"stock": arm(1.0), "auto": arm(ratio)}


def _sweep(commit, ratios, path="/a/reasoner"):
    loads = {str(c): {"arms": _arms(r), "median_run": 0, "median_by": "auto", "runs": [_arms(r)], "concurrency": c}
             for c, r in zip((1, 4), ratios)}
    return {"loads": loads, "settings": {**SETTINGS, "model_path": path}, "tasks": {"problems": 32},
            "max_tokens": 1200, "routing_rule": "headroom", "commit": commit, "machine": {"cores": 2}}


def test_three_sweeps_become_one_with_the_median_run_per_load():
    merged = merge([_sweep("c1", (0.5, 0.9)), _sweep("c2", (0.7, 0.8), path="/b/reasoner"), _sweep("c3", (0.6, 1.2))])
    assert merged["run_commits"] == ["c1", "c2", "c3"] and merged["commit"] == "c3"
    assert [r["auto"]["correct_per_s"] for r in merged["loads"]["1"]["runs"]] == [0.5, 0.7, 0.6]
    assert merged["loads"]["1"]["arms"]["auto"]["correct_per_s"] == 0.6 and merged["loads"]["1"]["median_run"] == 2
    assert merged["loads"]["4"]["arms"]["auto"]["correct_per_s"] == 0.9 and merged["loads"]["4"]["median_run"] == 0
    assert merged["loads"]["4"]["summary"]["auto"]["correct_per_s_ratio_to_stock"] == [0.9, 0.8, 1.2]
    assert merged["loads"]["1"]["concurrency"] == 1


@pytest.mark.parametrize("change, field", [
    (lambda r: r["settings"].update(kv_cache_bytes=8 << 20), "settings.kv_cache_bytes"),
    (lambda r: r.update(tasks={"problems": 64}), "tasks"),
    (lambda r: r["loads"].pop("4"), "loads"),
    (lambda r: r["loads"]["1"].update(arms={"stock": {}}), "arms"),
])
def test_results_that_measured_something_else_are_refused_by_name(change, field):
    other = _sweep("c2", (0.7, 0.8))
    change(other)
    with pytest.raises(ValueError, match=f"`{field}`"):
        merge([_sweep("c1", (0.5, 0.9)), other])


def test_the_cli_writes_the_merged_json_and_refuses_a_mismatch(tmp_path):
    from kvtier.cli import app

    paths = []
    for i, ratios in enumerate(((0.5, 0.9), (0.7, 0.8))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(_sweep(f"c{i}", ratios)))
    out = tmp_path / "merged.json"
    r = CliRunner().invoke(app, ["bench", "goodput-merge", *map(str, paths), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["run_commits"] == ["c0", "c1"]
    bad = _sweep("c9", (0.1, 0.1))
    bad["max_tokens"] = 4000
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = CliRunner().invoke(app, ["bench", "goodput-merge", str(paths[0]), str(tmp_path / "bad.json")])
    assert r.exit_code == 2 and "max_tokens" in r.output, r.output
