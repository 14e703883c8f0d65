"""Policies with parameters in an evaluation grid (issue #39 item 3: a `kvtier eval reasoner` grid over
random_reserve's ρ): `--policies` parsing and refusal, distinct cell names, the request's kvtier_params,
and summaries that keep two variants of one policy apart (pure Python); the passcode probe with variants
(the reference engine on the tiny model)."""

import json

import pytest

from kvtier.evaluation.policy_spec import parse_policies, parse_policy_spec, variant_name
from kvtier.evaluation.runner import Cell, make_grid


@pytest.mark.parametrize("item, want", [
    ("random", ("random", {})),
    ("random_reserve:reserve=0.05", ("random_reserve", {"reserve": 0.05})),
    ("random_reserve:reserve=0", ("random_reserve", {"reserve": 0})),
    ("rkv:protect_prompt=true:sinks=4", ("rkv", {"protect_prompt": True, "sinks": 4})),
    ("x:mode=fast", ("x", {"mode": "fast"})),                       # not JSON: a string
    ("x:v=[1]", ("x", {"v": "[1]"})),                               # JSON, not a scalar: a string
])
def test_policy_items_parse(item, want):
    assert parse_policy_spec(item) == want


@pytest.mark.parametrize("item, match", [
    ("random_reserve:reservee=0.1", "reservee"),                  # unknown parameter, by name
    ("random_reserve:reserve=1.5", "reserve"),                    # a bad value, by the policy's check
    ("nosuch:reserve=0.1", "unknown policy 'nosuch'"),
    ("random_reserve:reserve", "key=value"),
    ("random_reserve:reserve=0.1:reserve=0.2", "twice"),
    (":reserve=0.1", "no policy name"),
    ("full:reserve=0.1", "no parameters"),
])
def test_bad_policy_items_are_refused_by_name(item, match):
    with pytest.raises(ValueError, match=match):
        parse_policies(["random", item])
    with pytest.raises(ValueError, match=match):          # make_grid refuses too: no silently skipped cell
        make_grid(["random", item], [256])


@pytest.mark.parametrize("args, bad", [
    (["--policies", "random,random_reserve:reservee=0.1"], "reservee"),
    (["--policies", "random,nosuch"], "nosuch"),
])
def test_eval_reasoner_refuses_a_bad_policy_before_any_engine(args, bad):
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "reasoner", *args, "--out", "/nonexistent/never-written"])
    assert res.exit_code == 2, res.output + repr(res.exception)
    assert bad in res.output and "--policies" in res.output


def test_cells_name_variants_apart_and_requests_carry_the_params():
    cells = make_grid(["random", "rkv", "random_reserve:reserve=0.05", "random_reserve:reserve=0.1"], [256, 512])
    assert len(cells) == 1 + 4 * 2 and len({c.label for c in cells}) == len(cells)
    a, b = [c for c in cells if c.policy == "random_reserve" and c.budget == 256]
    assert (a.method, b.method) == ("random_reserve(reserve=0.05)", "random_reserve(reserve=0.1)")
    assert b.label == "random_reserve(reserve=0.1)@K=256" and a != b
    assert Cell("random_reserve", 256, "off", {"reserve": 0.1}).method == "random_reserve(reserve=0.1)-prompt"
    assert next(c for c in cells if c.policy == "random" and c.budget == 256).method == "random"
    assert variant_name("x", {"b": True, "a": "s"}) == "x(a=s,b=true)"          # sorted, as typed
    # the vLLM request (runner._run_vllm) and the reference engine's spec carry the parameters
    args = b.extra_args(32, 7)
    assert args["kvtier_policy"] == "random_reserve" and args["kvtier_params"] == {"reserve": 0.1}
    assert args["kvtier_budget"] == 256 and args["kvtier_seed"] == 7
    assert "kvtier_params" not in next(c for c in cells if c.policy == "rkv").extra_args(32, 7)
    assert Cell("full").extra_args(32, 7) is None
    spec = b.spec(32, 7)
    assert spec.params == {"reserve": 0.1} and spec.make_policy().reserve == 0.1


def _instances(correct: dict[str, list[bool]]) -> list[dict]:
    """Synthetic runner records: one kind, K = 256, one run, method -> per-problem correctness."""
    policy = {"full": ("full", {}, None), "random_reserve(reserve=0.05)": ("random_reserve", {"reserve": 0.05}, 256),
              "random_reserve(reserve=0.1)": ("random_reserve", {"reserve": 0.1}, 256)}
    rows = []
    for method, oks in correct.items():
        pol, params, budget = policy[method]
        for i, ok in enumerate(oks):
            rows.append({"task": "needle", "pid": f"needle-{i}", "run": 0, "method": method, "policy": pol,
                         "params": params, "budget": budget, "protect": "default", "correct": ok,
                         "generated_tokens": 100, "finish_reason": "stop"})
    return rows


def test_summaries_keep_two_variants_of_one_policy_apart():
    from kvtier.evaluation.reasoner_eval import markdown_table, summarize_cells
    from kvtier.evaluation.report import summarize, table1

    n = 12
    inst = _instances({"full": [True] * n, "random_reserve(reserve=0.05)": [False] * n,
                       "random_reserve(reserve=0.1)": [True] * (n - 1) + [False]})
    summary = summarize(inst, reference="full", n_boot=200)
    assert set(summary["methods"]) == {"full", "random_reserve(reserve=0.05)", "random_reserve(reserve=0.1)"}
    result = summarize_cells(inst, summary)
    cells = {c["method"]: c for c in result["cells"]}
    assert set(cells) == set(summary["methods"]) and len(result["cells"]) == 3
    lo, hi = cells["random_reserve(reserve=0.05)"], cells["random_reserve(reserve=0.1)"]
    assert lo["policy"] == hi["policy"] == "random_reserve"                   # readers keyed by policy still work
    assert (lo["params"], hi["params"], cells["full"]["params"]) == ({"reserve": 0.05}, {"reserve": 0.1}, {})
    assert (lo["accuracy"], hi["accuracy"]) == (0.0, (n - 1) / n)
    assert lo["vs_full"]["significant"] and lo["vs_full"]["diff"] == -1.0     # its own pair with full
    assert not hi["vs_full"]["significant"]
    table = markdown_table(result)
    assert "| random_reserve(reserve=0.05) | 0.000" in table and "| random_reserve(reserve=0.1) | 0.917" in table
    assert "random_reserve(reserve=0.1)" in table1(summary)


def test_plot_draws_one_line_per_variant(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvtier.evaluation import reasoner_plot

    cell = lambda method, pol, b, acc: {"policy": pol, "method": method, "budget": b, "kind": "needle",  # noqa: E731
                                         "accuracy": acc, "ci": [acc, acc]}
    result = {"config": {}, "cells": [cell("full", "full", None, 1.0)] + [
        cell(m, p, b, acc) for m, p, acc in [("random", "random", 0.5), ("random_reserve(reserve=0.05)",
                                             "random_reserve", 0.6), ("random_reserve(reserve=0.1)", "random_reserve", 0.7)]
        for b in (256, 512)]}
    seen = []
    orig = plt.Axes.errorbar
    plt.Axes.errorbar = lambda self, *a, **k: seen.append((k["label"], k["color"])) or orig(self, *a, **k)
    try:
        reasoner_plot.plot_accuracy_vs_budget(result, tmp_path / "p.png")
    finally:
        plt.Axes.errorbar = orig
    assert [s[0] for s in seen] == ["random", "random_reserve(reserve=0.05)", "random_reserve(reserve=0.1)"]
    assert len({s[1] for s in seen}) == 3 and (tmp_path / "p.png").stat().st_size > 0


def test_probe_passcode_takes_policy_variants(tiny_model_dir, tmp_path):
    """`kvtier eval probe-passcode --policies random,random_reserve:reserve=0.25`: each variant its own row,
    and the reserve is what the engine ran (ρ = 0.25 keeps a different set than random on the same seed)."""
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "probe-passcode", "--model", str(tiny_model_dir), "--n", "2",
                                   "--budget", "48", "--buffer", "16", "--threads", "1", "--distance", "4",
                                   "--seed", "2", "--out", str(tmp_path), "--policies",
                                   "full,random,random_reserve:reserve=0.25"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    pc = json.loads((tmp_path / "passcode.json").read_text())
    rows = pc["policies"]
    assert set(rows) == {"full", "random", "random_reserve(reserve=0.25)"}
    assert "| random_reserve(reserve=0.25) |" in res.output
    assert rows["random_reserve(reserve=0.25)"]["mean_logp"] != rows["random"]["mean_logp"]


def test_probe_passcode_refuses_a_bad_variant_before_loading():
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "probe-passcode", "--model", "/nonexistent/model", "--out",
                                   "/nonexistent/never-written", "--policies", "random_reserve:reserve=2"])
    assert res.exit_code == 2, res.output + repr(res.exception)
    assert "reserve" in res.output and "--policies" in res.output
