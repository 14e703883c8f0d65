"""Evaluation harness (issue 9): the reference engine's keep-sets against vLLM's, grader, statistics, pipeline,
probes, keep-log, GPU script (the reference engine alone: tests/test_reference.py).

CPU, tiny Qwen3 (random weights: accuracies are ~0, the mechanics are what is tested). One in-process vLLM
engine for the module; torch runs single-threaded here (the CI machine has 2 shared cores).
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from kvtier.engine.config import EvictionSpec
from kvtier.evaluation.grader import extract_boxed_all, extract_final_boxed, grade, grader_backend
from kvtier.evaluation.stats import bootstrap_replicates, compare, paired_bootstrap, sign_test
from kvtier.reference import Request, round_schedule

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "src" / "kvtier" / "evaluation" / "data" / "synthetic_math.jsonl"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    from kvtier.engine.api import build_llm

    audit = str(tmp_path_factory.mktemp("eval_audit") / "audit.jsonl")
    llm = build_llm(tiny_model_dir, eviction={"default": {"buffer": 16}, "audit_log": audit},
                    kv_cache_bytes=32 << 20, max_model_len=1024, max_num_seqs=32, enforce_eager=True)
    return llm, audit


PROMPTS = [list(range(10, 40)), list(range(100, 117)), list(range(200, 251))]


# ----------------------------------------------------------------------------------------------- grader
SYMBOLIC = pytest.mark.skipif(grader_backend() != "math-verify", reason="symbolic equivalence needs math-verify")


@pytest.mark.parametrize("response,gold,ok", [
    pytest.param(r"so $x=\boxed{\frac{1}{\sqrt{2}}}$.", r"\frac{\sqrt{2}}{2}", True, marks=SYMBOLIC),  # nested, symbolic
    pytest.param(r"\boxed{ 1 / 2 }", r"\frac{1}{2}", True, marks=SYMBOLIC),       # spaces, \frac
    pytest.param(r"\boxed{\dfrac{3}{4}}", "0.75", True, marks=SYMBOLIC),
    (r"\boxed{ \dfrac{3}{4} }", r"\frac34", True),                                # spaces, \dfrac (string level)
    (r"first \boxed{3}. Wait, no: \boxed{4}", "4", True),                       # multiple boxes: last one
    (r"first \boxed{3}. Wait, no: \boxed{4}", "3", False),
    (r"the answer is 5", "5", False),                                            # missing box
    (r"\boxed{12", "12", False),                                                 # unbalanced (truncated)
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True),                                      # escaped braces inside
    (r"\boxed{\text{(B)}}", "B", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{1{,}000}", "1000", True),
    (r"\boxed{90^\circ}", "90", True),
    pytest.param(r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True, marks=SYMBOLIC),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{11}", False),
    (r"\boxed 7.", "7", True),
    (r"\fbox{42}", "42", True),
])
def test_grader_on_boxed_edge_cases(response, gold, ok):
    g = grade(response, gold)
    assert g.correct is ok, (response, gold, g)


def test_boxed_extraction_is_brace_matched_and_last_wins():
    assert extract_boxed_all(r"\boxed{a{b}{c}d} x \boxed {e}") == ["a{b}{c}d", "e"]
    assert extract_final_boxed(r"\boxed{\frac{1}{2}} then \boxed{\frac{3}{\sqrt{5}}}") == r"\frac{3}{\sqrt{5}}"
    assert extract_final_boxed("no box") is None
    assert grader_backend() in ("math-verify", "string")


# ----------------------------------------------------------------------------------------------- statistics
def test_sign_test_hand_computed():
    # 8 problems better, 2 worse, 3 ties: p = 2 * P(X >= 8 | n=10) = 2 * (45 + 10 + 1) / 1024
    a = {i: [1.0] if i < 8 or i >= 10 else [0.0] for i in range(13)}
    b = {i: [0.0] if i < 8 else [1.0] for i in range(13)}
    st = sign_test(a, b)
    assert (st["n_pos"], st["n_neg"], st["n_ties"]) == (8, 2, 3)
    assert st["p"] == pytest.approx(112 / 1024, abs=1e-12)
    all_better = sign_test({i: [1] for i in range(10)}, {i: [0] for i in range(10)})
    assert all_better["p"] == pytest.approx(2 / 1024, abs=1e-12)


def test_tests_are_problem_clustered():
    # Two runs each; problem 0: A right twice, B wrong twice; problem 1: both always right.
    a, b = {0: [1, 1], 1: [1, 1]}, {0: [0, 0], 1: [1, 1]}
    st = sign_test(a, b)
    assert (st["n_pos"], st["n_neg"], st["n_ties"], st["p"]) == (1, 0, 1, 1.0)  # one problem, not two runs
    bs = paired_bootstrap(a, b, n_boot=4000, seed=1)
    assert bs["diff"] == 0.5 and bs["n_problems"] == 2


def test_bootstrap_against_exact_resampling_distribution():
    # d = [0, 1]: resampled means are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4.
    reps = bootstrap_replicates(torch.tensor([0.0, 1.0]).numpy(), n_boot=20000, seed=3)
    for value, prob in [(0.0, 0.25), (0.5, 0.5), (1.0, 0.25)]:
        assert (reps == value).mean() == pytest.approx(prob, abs=0.015)
    bs = paired_bootstrap({0: [1], 1: [1]}, {0: [1], 1: [0]}, n_boot=4000, seed=0)
    assert (bs["diff"], bs["lo"], bs["hi"]) == (0.5, 0.0, 1.0)
    # d = [0, 0, 1]: P(mean <= 2/3) = 26/27 = 0.963 < 0.975, so the upper 97.5% point is 1; lower is 0.
    bs = paired_bootstrap({i: [1 if i == 2 else 0] for i in range(3)}, {i: [0] for i in range(3)}, seed=0)
    assert (bs["lo"], bs["hi"]) == (0.0, 1.0)
    # constant differences: a degenerate interval, significant with enough problems
    c = compare({i: [1] for i in range(12)}, {i: [0] for i in range(12)})
    assert (c.lo, c.hi, c.significant, c.direction) == (1.0, 1.0, True, 1)
    c = compare({i: [1] for i in range(5)}, {i: [0] for i in range(5)})  # CI excludes 0 but p = 1/16
    assert c.lo == 1.0 and c.p_sign == pytest.approx(1 / 16) and not c.significant


# ------------------------------------------------------------------------------------------ reference vs vLLM engine
def test_random_keep_sets_identical_to_vllm_engine(ref, vllm_engine):
    """Same eviction seed, same schedule: the transformers reference and the compressed vLLM engine keep
    exactly the same positions in every (layer, KV head) at every round (tokens may differ: bf16 vs fp32)."""
    from vllm import SamplingParams

    from engine_helpers import records_for

    llm, audit = vllm_engine
    specs = [EvictionSpec(policy="random", budget=48, buffer=16, seed=5),
             EvictionSpec(policy="random", budget=40, buffer=16, protect_prompt=False, seed=9)]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2,
                        [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True,
                                        extra_args=s.to_extra_args()) for s in specs], use_tqdm=False)
    mine = ref.generate([Request(PROMPTS[0], s, max_new_tokens=120) for s in specs])
    for o, m in zip(outs, mine):
        theirs = [r for r in records_for(audit, o.request_id) if "kept" in r]
        assert len(theirs) == len(m.records) >= 5
        for a, b in zip(theirs, m.records):
            assert (a["query_position"], a["kept"]) == (b["query_position"], b["kept"])


# ----------------------------------------------------------------------------------------------- pipeline
def _check_outputs(out: Path, n_instances: int):
    rows = [json.loads(l) for l in (out / "instances.jsonl").read_text().splitlines()]
    assert len(rows) == n_instances
    for r in rows:
        for key in ("task", "pid", "run", "cell", "method", "budget", "protect", "generated_tokens", "correct", "gold"):
            assert key in r
    summary = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "Table 7" in report and "Table 8" in report and "policy-vs-policy" in report
    return rows, summary, report


def test_eval_pipeline_end_to_end_on_the_vllm_engine(vllm_engine, tiny_model_dir, tmp_path):
    from kvtier.evaluation.report import write_reports
    from kvtier.evaluation.runner import EvalConfig, make_grid, read_instances, run_eval
    from kvtier.evaluation.tasks import load_tasks

    llm, _ = vllm_engine
    problems = load_tasks(TASKS, limit=3)
    # K=32 cannot protect the 41-token prompts: random (protects by default) is skipped, snapkv runs.
    cells = make_grid(["random", "snapkv"], [32, 48], ["default"])
    cfg = EvalConfig(engine="vllm", model=tiny_model_dir, runs=2, max_tokens=64, buffer=16, temperature=0.6)
    path = run_eval(problems, cells, cfg, tmp_path, llm=llm)
    write_reports(read_instances(path), tmp_path)
    rows, summary, report = _check_outputs(tmp_path, 3 * len(cells) * 2)
    done = [r for r in rows if r["correct"] is not None]
    assert all(r["generated_tokens"] == 64 for r in done)                      # the tiny model never stops
    assert all(r["rounds"] >= 2 for r in done if r["policy"] != "full")
    skipped = [r for r in rows if r["correct"] is None]
    assert {(r["policy"], r["budget"]) for r in skipped} == {("random", 32)}
    assert "†" in report
    # paired seeds: a (problem, run) has one seed across cells
    seeds = {(r["pid"], r["run"]): set() for r in rows}
    for r in rows:
        seeds[(r["pid"], r["run"])].add(r["seed"])
    assert all(len(s) == 1 for s in seeds.values())
    cell = summary["cells"]["synthetic_math@K=48|snapkv"]
    assert cell["runs"] == 2 and cell["problems"] == 3 and cell["mean_generated_tokens"] == 64
    assert "vs_reference" in cell and len(cell["per_run_accuracy"]) == 2
    cols = {p["column"] for p in summary["pairwise"]}
    assert cols == {"synthetic_math@K=48", "synthetic_math@K=32"}
    # keep-log statistics straight from the engine's audit log, labelled by the instances' methods
    from kvtier.evaluation.cli import _keeplog_report

    stats = _keeplog_report([Path(vllm_engine[1])], tmp_path / "keeplog", instances=rows)
    assert stats["random@K=48"]["prompt_survival_union"] == 1.0 and stats["random@K=48"]["budget"] == 48
    assert stats["snapkv@K=32"]["rounds"] > 0 and stats["snapkv@K=32"]["protected"] == 0


def test_eval_cli_end_to_end_on_the_reference_engine(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    out = tmp_path / "ref"
    res = CliRunner().invoke(app, [
        "eval", "run", "--tasks", str(TASKS), "--model", tiny_model_dir, "--out", str(out), "--engine", "reference",
        "--policies", "random,recency", "--budgets", "48", "--protect", "default,off", "--runs", "2", "--limit", "2",
        "--max-tokens", "72", "--buffer", "16", "--device", "cpu", "--dtype", "float32", "--audit", "--threads", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows, summary, report = _check_outputs(out, 2 * (1 + 4) * 2)
    assert {r["method"] for r in rows} == {"full", "random", "random-prompt", "recency", "recency-prompt"}
    assert summary["reference"] == "random"
    assert len([p for p in summary["pairwise"]]) == 10                        # 5 methods, one column
    keep = json.loads((out / "keeplog.json").read_text())
    assert set(keep) == {"random@K=48", "random-prompt@K=48", "recency@K=48", "recency-prompt@K=48"}
    assert keep["random@K=48"]["prompt_survival_union"] == 1.0                 # random protects the prompt
    assert keep["random-prompt@K=48"]["prompt_survival_per_head"] < 1.0
    if importlib.util.find_spec("matplotlib") is not None:      # the plot is skipped without it
        assert (out / "figure4_survival_by_age.png").stat().st_size > 0
    res = CliRunner().invoke(app, ["eval", "report", "--instances", str(out / "instances.jsonl"), "--out",
                                   str(tmp_path / "again"), "--reference", "recency"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["reference"] == "recency"


# ----------------------------------------------------------------------------------------------- probes
def test_planted_fact_probe_pins_exactly_the_chosen_heads(ref, tok):
    from kvtier.evaluation.probes import run_planted_fact, verify_pins

    L = ref.num_layers
    head0 = {(l, 0) for l in range(L)}
    conds = {"head0": head0, "l1h1": {(1, 1)}}
    res = run_planted_fact(ref, tok, conds, n=2, budget=48, buffer=16, distance=3, seed=1, n_boot=200)
    c = res["conditions"]
    assert c["kept"]["R"] == pytest.approx(1.0) and c["deleted"]["R"] == pytest.approx(0.0)
    for name in ("kept", "deleted", "head0", "l1h1"):
        assert c[name]["pins_checked"] > 0 and c[name]["pin_violations"] == 0
        assert 0.0 <= c[name]["retrieval"] <= 1.0 and math.isfinite(c[name]["mean_lp"])
    # The audit log itself: at every round after the fact left the buffer, exactly the chosen sites hold it.
    inst = res["instances_detail"][0]
    a, b = inst.facts[0]
    out = next(o for o in res["outputs"] if o.req_id == "head0/0")
    checked = 0
    for rec in out.records:
        if rec["query_position"] - rec["buffer"] < b - 1:
            continue
        checked += 1
        for l in range(L):
            for h in range(ref.num_kv_heads):
                held = {p for p in rec["kept"][l][h] if a <= p < b}
                assert held == (set(range(a, b)) if (l, h) in head0 else set())
    assert checked == 3                                                      # `distance` rounds before the query
    # ... and the check can fail: the same log does not match other sites.
    assert not verify_pins(out.records, [(a, b, {(1, 1)})])["ok"]


def test_passcode_probe_runs_every_policy(ref, tok):
    from kvtier.evaluation.probes import build_instances, run_passcode

    res = run_passcode(ref, tok, ["random", "snapkv", "full"], n=2, budget=48, buffer=16, distance=4, seed=2)
    assert set(res["policies"]) == {"random", "snapkv", "full"}
    for v in res["policies"].values():
        assert 0.0 <= v["retrieval"] <= 1.0 and v["mean_logp"] < 0
    inst = build_instances(tok, n=1, budget=48, buffer=16, distance=4, kind="passcode", seed=2)[0]
    P, (_, b) = len(inst.prompt_ids), inst.facts[0]
    qps = round_schedule(P, P + len(inst.body), EvictionSpec(policy="random", budget=48, buffer=16))
    assert len([q for q in qps if q - 16 >= b - 1]) == 4       # passcode candidate in exactly 4 rounds


def test_probe_commands_write_json_and_table(tiny_model_dir, tmp_path):
    """`kvtier eval probe-passcode` / `probe-fact`: the JSON and the table land in --out, the table is printed."""
    from typer.testing import CliRunner

    from kvtier.cli import app

    small = ["--model", str(tiny_model_dir), "--n", "2", "--budget", "48", "--buffer", "16", "--threads", "1"]
    res = CliRunner().invoke(app, ["eval", "probe-passcode", *small, "--out", str(tmp_path / "pc"),
                                   "--policies", "random,full", "--distance", "4", "--seed", "2"])
    assert res.exit_code == 0, res.output
    pc = json.loads((tmp_path / "pc" / "passcode.json").read_text())
    assert set(pc["policies"]) == {"random", "full"}
    assert (tmp_path / "pc" / "passcode.md").read_text() in res.output
    res = CliRunner().invoke(app, ["eval", "probe-fact", *small, "--out", str(tmp_path / "pf"),
                                   "--conditions", "h0=0;h01=0,1", "--distance", "3", "--seed", "1"])
    assert res.exit_code == 0, res.output
    pf = json.loads((tmp_path / "pf" / "planted_fact.json").read_text())
    assert {"h0", "h01", "kept", "deleted"} <= set(pf["conditions"])
    assert pf["conditions"]["h0"]["pin_violations"] == 0 and "outputs" not in pf
    assert (tmp_path / "pf" / "planted_fact.md").read_text() in res.output


# ----------------------------------------------------------------------------------------------- keep-log
def test_keeplog_statistics_of_random_match_closed_forms(ref):
    """Survival after n rounds of candidacy is ((K - ℓp)/(K + r - ℓp))^n in steady state; the prompt
    survives in every head; coverage and survival by age are fractions."""
    from kvtier.evaluation.keeplog import keeplog_stats

    K, r, P = 48, 16, list(range(10, 30))
    outs = ref.generate([Request(P, EvictionSpec(policy="random", budget=K, buffer=r, seed=s), max_new_tokens=360)
                         for s in range(4)])
    st = keeplog_stats([rec for o in outs for rec in o.records])
    assert st["protected"] == len(P)
    q = (K - len(P)) / (K + r - len(P))
    rows = {x["n"]: x for x in st["survival_by_rounds_steady"]}
    for n in range(1, 6):
        assert rows[n]["closed_form"] == pytest.approx(q ** n)
        assert rows[n]["survival"] == pytest.approx(q ** n, abs=0.03), (n, rows[n])
    for x in st["survival_by_rounds"][:5]:                    # including the first (partial) round
        assert x["survival"] == pytest.approx(x["expected_random"], abs=0.03)
    assert st["prompt_survival_union"] == 1.0 and st["prompt_survival_per_head"] == 1.0
    assert 0.5 < st["slot_coverage"] <= 1.0
    ages = st["survival_by_age_per_head"]
    assert ages and all(0 <= x["survival"] <= 1 for x in ages)
    assert [x["survival"] for x in ages] == sorted([x["survival"] for x in ages], reverse=True)  # decays
    union = {(x["age_lo"], x["age_hi"]): x["survival"] for x in st["survival_by_age_union"]}
    assert all(union[(x["age_lo"], x["age_hi"])] >= x["survival"] for x in ages)


# ----------------------------------------------------------------------------------------------- GPU script
def test_gpu_table10_script_smoke_on_cpu(capsys):
    import importlib

    mod = importlib.import_module("kvtier.benchmarks.gpu_table10")
    res = mod.main(["--tiny", "--device", "cpu", "--policies", "full,random,snapkv", "--steps", "20",
                    "--rounds-repeats", "1"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["decode"].keys() == res["decode"].keys() == {"full", "random", "snapkv"}
    for m, r in res["decode"].items():
        assert "error" not in r, r
        assert r["tok_per_s"] > 0 and r["steps"] == 20
        assert (r["sequence_rounds"] > 0) == (m != "full")
    assert "error" not in res["rounds"], res["rounds"]
    assert set(res["rounds"]["policies"]) == {"random", "snapkv"}
    assert res["shapes"]["budget"] == 32
