"""`kvtier bench goodput`: graded problems through stock vLLM's server and kvtier serve's tiers, driven by
vLLM's own serving benchmark, stopping at EOS. The end-to-end run is tiny (2 problems per kind); the
statistics are checked on hand-made per-problem results. No timing is asserted: speed claims come from
the committed runs (results/goodput-*.json)."""

import json

import pytest

from kvtier.benchmarks.goodput import load_tasks, main_arm, summarize_arm


def _raw(arm, correct, lengths, kinds=None, seconds=10.0):
    kinds = kinds or ["local", "needle"] * (len(correct) // 2)
    return {"arm": arm, "duration_s": seconds, "tok_per_s": sum(lengths) / seconds, "failed": 0,
            "ttft_ms": 50.0, "ttft_p50_ms": 45.0, "ttft_p99_ms": 90.0, "e2el_ms": 900.0, "e2el_p99_ms": 1500.0,
            "preemptions": 0.0, "eviction_events": 4.0,
            "per_problem": [{"pid": f"p{i}", "kind": k, "correct": c, "output_tokens": n, "failed": False}
                            for i, (c, n, k) in enumerate(zip(correct, lengths, kinds))]}


def test_summary_counts_accuracy_goodput_and_length_ratio_by_hand():
    full = _raw("full", [True, True, True, True], [100, 100, 100, 100], seconds=20.0)
    k = _raw("k256", [True, False, True, True], [110, 130, 100, 100], seconds=10.0)
    s = summarize_arm(k, full)
    assert s["accuracy"] == {"local": 1.0, "needle": 0.5}
    assert s["correct"] == 3 and s["correct_per_s"] == 0.3
    assert s["length_ratio_to_full"] == pytest.approx(440 / 400)
    assert s["mean_output_tokens"] == 110.0
    assert s["ci"]["needle"]["vs_full"]["diff"] == -0.5 and "vs_full" in s["ci"]["local"]
    own = summarize_arm(full, full)
    assert own["length_ratio_to_full"] == 1.0 and "vs_full" not in own["ci"]["local"]


def test_an_arms_router_counts_are_what_changed_during_it():
    from kvtier.benchmarks.goodput import counts_since

    before = {"tightenings": 2.0, "final_budgets": {"full": 3, "512": 1}, "router_errors": {"503 engine-unavailable": 1}}
    after = {"tightenings": 5.0, "final_budgets": {"full": 3, "512": 4, "256": 2},
             "router_errors": {"503 engine-unavailable": 2, "504 timeout": 1}}
    assert counts_since(before, after) == {"tightenings": 3.0, "final_budgets": {"256": 2, "512": 3},
                                           "router_errors": {"503 engine-unavailable": 1, "504 timeout": 1}}
    assert counts_since(None, None) == {"tightenings": None, "final_budgets": None, "router_errors": None}   # stock


def test_tasks_reasoner_default_and_jsonl(tmp_path):
    tasks = load_tasks("reasoner", 3)
    assert [t.kind for t in tasks] == ["local", "needle"] * 3 and len({t.pid for t in tasks}) == 6
    assert all(t.prompt.endswith("\n") and len(t.answer) == 2 for t in tasks)
    local = load_tasks("reasoner", 3, kinds=("local",))           # the local-chain workload
    assert [t.pid for t in local] == [t.pid for t in tasks if t.kind == "local"]
    assert [t.prompt for t in local] == [t.prompt for t in tasks if t.kind == "local"]
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="needs 'prompt' and 'answer'"):
        load_tasks(str(f), 0)
    f.write_text(json.dumps({"prompt": "2+2=", "answer": 4, "kind": "math"}) + "\n")
    assert load_tasks(str(f), 0)[0].answer == "4"
    assert main_arm(["stock", "full", "k512"]) == "k512" and main_arm(["stock", "auto", "k512"]) == "auto"


def test_unknown_arm_is_a_usage_error():
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["bench", "goodput", "--arms", "stock,k999"])
    assert r.exit_code == 2 and "k999" in r.output


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_bench_goodput_stock_and_two_kvtier_arms(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("ray.serve")
    from test_benchmarks import run_json

    out, plot = tmp_path / "goodput.json", tmp_path / "goodput.png"
    r = run_json(["bench", "goodput", "--problems", "2", "--arms", "stock,full,k512", "--concurrency", "4",
                  "--workdir", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)])
    assert json.loads(out.read_text()) == r and plot.stat().st_size > 1000
    from kvtier.service.sizing import DTYPE_BYTES, kv_bytes_per_token

    # the demo config's model records its family (the long reasoner: chains-long), and --kv-bytes auto is 4
    # traces of that family's 4,096 tokens in the dtype `auto` picked
    assert r["tasks"] == {"problems": 4, "kinds": ["local", "needle"], "family": "chains-long"}
    per_token = kv_bytes_per_token(r["settings"]["model_path"], DTYPE_BYTES[r["settings"]["dtype"]])
    assert r["commit"] and r["machine"]["cores"] >= 1 and r["settings"]["kv_cache_bytes"] == 4 * 4096 * per_token
    assert r["routing_rule"] == "headroom" and r["settings"]["client_nice"] is None
    arms = r["arms"]
    assert set(arms) == {"stock", "full", "k512"} and len(r["runs"]) == 1
    for name, a in arms.items():
        assert a["problems"] == 4 and a["failed"] == 0, (name, a.get("errors"))  # every answer came back, graded
        assert set(a["accuracy"]) == {"local", "needle"}
        assert a["length_ratio_to_full"] > 0 and a["mean_output_tokens"] > 100 and a["correct_per_s"] >= 0
        assert 0 < a["ttft_p50_ms"] <= a["ttft_p99_ms"] and a["ttft_ms"] > 0 and a["e2el_p99_ms"] >= a["e2el_ms"] * 0.5
    assert min(arms["full"]["accuracy"].values()) >= 0.9 and arms["full"]["correct_per_s"] > 0
    assert arms["stock"]["correct_per_s"] > 0 and arms["stock"]["correct_per_s_ratio_to_stock"] == 1.0
    assert arms["full"]["eviction_events"] == 0 and arms["k512"]["eviction_events"] > 0
    # every answer's final budget, from its usage.kvtier: full attention, or the fixed tier's K
    assert arms["full"]["final_budgets"] == {"full": 4} and arms["k512"]["final_budgets"] == {"512": 4}
    assert arms["stock"]["final_budgets"] is None
    # and the router counted no 5xx of its own (refused, or an engine lost mid-stream)
    assert arms["full"]["router_errors"] == {} == arms["k512"]["router_errors"] and arms["stock"]["router_errors"] is None
    # a kvtier arm's time to first token by the router's segments (stock has no router)
    assert "ttft_breakdown_ms" not in arms["stock"]
    assert all(arms[a]["ttft_breakdown_ms"]["engine"]["mean_ms"] > 0 for a in ("full", "k512")), arms
    # the client's own stalls, every arm (a client not scheduled inflates its TTFT: client_clock.py)
    assert all(set(a["client_stalls"]) == {"stalls", "max_ms", "total_ms", "descheduled_ms"} for a in arms.values())
    # the machine's speed just before and after each arm (a drift between arms shows in the JSON)
    assert all(len(a["speed_probe_ms"]) == 2 and min(a["speed_probe_ms"]) > 0 for a in arms.values()), arms


def test_load_sweep_runs_every_arm_at_every_load_and_plots(tmp_path, monkeypatch):
    """--concurrency 1,4: one run_goodput per load (here a stand-in), kept under `loads` with the shared
    settings once; the plot draws one line per arm."""
    from kvtier.benchmarks import goodput_load

    calls = []

    def fake(settings, config, tasks, arms, runs, workdir, concurrency, max_tokens, seed, log, family, client_nice):
        calls.append(concurrency)
        arm = lambda c: {"accuracy": {"local": 1.0, "needle": 0.5}, "correct_per_s": 0.1 * c, "preemptions": 0,  # noqa: E731
                         "tightenings": c, "ci": {"local": {"accuracy": [1.0, 1.0]}, "needle": {"accuracy": [0.3, 0.7]}}}
        return {"arms": {a: arm(concurrency) for a in arms}, "runs": [{}], "concurrency": concurrency,
                "settings": {"kv_cache_bytes": 16 << 20, "dtype": "float32"}, "tasks": {"problems": 4},
                "machine": {"cores": 2}, "commit": "abc", "max_tokens": 1200, "routing_rule": "headroom"}

    monkeypatch.setattr(goodput_load, "run_goodput", fake)
    res = goodput_load.run_goodput_loads(None, {}, [], ["stock", "elastic"], 1, tmp_path, [1, 4], 1200, log=lambda m: None)
    assert calls == [1, 4] and list(res["loads"]) == ["1", "4"]
    assert res["loads"]["4"]["arms"]["elastic"]["tightenings"] == 4 and res["loads"]["4"]["concurrency"] == 4
    assert res["commit"] == "abc" and "settings" not in res["loads"]["1"]
    goodput_load.plot_loads(res, tmp_path / "loads.png")
    assert (tmp_path / "loads.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, hint", [(["--kinds", "local,haystack"], "--kinds"), (["--kinds", ","], "--kinds"),
                                        (["--kinds", "local,local"], "--kinds"),
                                        (["--tasks", "t.jsonl", "--kinds", "local"], "--kinds")])
def test_bad_kinds_are_a_usage_error(argv, hint):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["bench", "goodput", *argv, "--workdir", "/nonexistent/never"])
    assert r.exit_code == 2 and hint in r.output, r.output


def test_bad_concurrency_is_a_usage_error():
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["bench", "goodput", "--concurrency", "4,x", "--workdir", "/nonexistent/never"])
    assert r.exit_code == 2 and "--concurrency" in r.output, r.output
