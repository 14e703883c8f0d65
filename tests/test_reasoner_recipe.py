"""`kvtier model train-recipe` (src/kvtier/models/reasoner_recipe.py) and what it leans on in train-reasoner:
one recipe for both long models, phases chained and skipped when done, a pause ending the run, a checkpoint
resuming on another device (recorded), evictions simulated ahead in worker processes giving the same weights."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from kvtier.models.reasoner_recipe import RECIPES, phase_configs, run_recipe
from kvtier.models.reasoner_train import train
from kvtier.models.train_config import TrainConfig

TINY = dict(steps=2, batch=1, threads=1, held_out=1, warmup=1, dtype="float32")


def test_the_long_recipe_is_one_recipe_for_both_shapes(tmp_path):
    two = phase_configs("long", "long-2kv", tmp_path / "a")
    eight = phase_configs("long", "long-8kv", tmp_path / "b")
    assert [n for n, _, _ in two] == [n for n, _, _ in eight] == ["p1", "p2", "p3", "p3b", "p4", "p5", "evict"]
    for (_, out2, c2), (_, out8, c8) in zip(two, eight):
        strip = lambda c: {k: v for k, v in vars(c).items() if k not in ("shape", "init_from")}   # noqa: E731
        assert strip(c2) == strip(c8) and (c2.shape, c8.shape) == ("long-2kv", "long-8kv")
    prev = ""
    for name, out, cfg in eight:                      # each phase continues the one before
        assert cfg.init_from == prev and out == tmp_path / "b" / name
        assert cfg.dtype == "bfloat16"
        prev = str(out)
    assert eight[-1][2].evict.startswith("random:256,512,1024") and not any(c.evict for _, _, c in eight[:-1])
    assert sum(c.steps for _, _, c in eight[:-1]) == 7000
    # retrieval (reasoner_recipe._RETRIEVAL): p3 on the shorter family alone, p4 keeps it beside the long traces,
    # p5 bridges to the needle's distance with the middle family (training only); every phase ends on chains-long
    assert [c.family for _, _, c in eight] == ["chains-long", "chains-long", "chains", "chains", "chains-long",
                                              "chains-long", "chains-long"]
    assert [(c.aux_family, c.aux_batch) for _, _, c in eight] == [("", 0)] * 4 + [("chains", 8), ("chains-mid", 8),
                                                                                 ("", 0)]


def test_phases_run_in_order_skip_when_done_and_a_pause_ends_the_run(tmp_path):
    calls = []

    def fake_train(cfg, out, log):
        calls.append((out.name, cfg.init_from))
        if out.name == "p2" and len(calls) == 2:
            return {"paused_at": 7}
        out.mkdir(parents=True, exist_ok=True)
        (out / "TRAINING.json").write_text("{}")
        return {}

    res = run_recipe("long", "long-8kv", tmp_path, log=lambda s: None, train=fake_train)
    assert res == {"done": ["p1"], "paused": "p2", "at": 7}
    res = run_recipe("long", "long-8kv", tmp_path, through="p3b", log=lambda s: None, train=fake_train)
    assert res == {"done": ["p1", "p2", "p3", "p3b"]}
    # a pause asked for as a phase finished: that phase is done, no further one starts
    stop = lambda cfg, out, log: (fake_train(cfg, out, log), {"stop_requested": True})[1]   # noqa: E731
    res = run_recipe("long", "long-8kv", tmp_path, log=lambda s: None, train=stop)
    assert res == {"done": ["p1", "p2", "p3", "p3b", "p4"], "stopped_after": "p4"}
    calls.pop()
    assert calls == [("p1", ""), ("p2", str(tmp_path / "p1")), ("p2", str(tmp_path / "p1")), ("p3", str(tmp_path / "p2")),
                     ("p3b", str(tmp_path / "p3"))]
    with pytest.raises(ValueError, match="not a phase"):
        run_recipe("long", "long-8kv", tmp_path, through="p9", train=fake_train)
    with pytest.raises(ValueError, match="unknown recipe"):
        run_recipe("short", "long-8kv", tmp_path, train=fake_train)


def test_train_recipe_cli_refuses_an_unknown_shape_or_phase(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["model", "train-recipe", "--shape", "long-16kv", "--work", str(tmp_path)])
    assert r.exit_code == 2 and "--shape" in r.output and "long-8kv" in r.output, r.output
    r = CliRunner().invoke(app, ["model", "train-recipe", "--shape", "long-8kv", "--work", str(tmp_path), "--through", "p9"])
    assert r.exit_code == 2 and "p9" in r.output and "evict" in r.output, r.output
    r = CliRunner().invoke(app, ["model", "train-recipe", "--shape", "long-8kv", "--work", str(tmp_path), "--attention", "dense"])
    assert r.exit_code == 2 and "--attention" in r.output and "flex" in r.output, r.output
    assert not any(tmp_path.iterdir())


def test_a_paused_checkpoint_resumes_on_another_device_and_says_so(tmp_path):
    out, lines = tmp_path / "m", []

    def pause_after_first_step(s):
        lines.append(s)
        if s.startswith('{"step": 1,'):
            os.kill(os.getpid(), signal.SIGTERM)      # what `timeout` sends: pause at the next step boundary

    rec = train(TrainConfig(log_every=1, ckpt_every=1, **TINY), out, log=pause_after_first_step)
    assert rec == {"paused_at": 1} and (out / "ckpt.pt").exists()
    state = torch.load(out / "ckpt.pt", weights_only=False)
    assert state["devices"][0]["from_step"] == 0 and state["devices"][0]["device"].startswith("cpu")
    state["devices"] = [{"from_step": 0, "device": "cuda:0 (NVIDIA H200)"}]      # as if step 0 ran on a GPU
    torch.save(state, out / "ckpt.pt")
    lines.clear()
    rec = train(TrainConfig(log_every=1, ckpt_every=1, **TINY), out, log=lines.append)
    assert [d["from_step"] for d in rec["devices"]] == [0, 1]
    assert rec["devices"][0]["device"] == "cuda:0 (NVIDIA H200)" and rec["devices"][1]["device"].startswith("cpu")
    assert any("steps before 1 ran on cuda:0" in s for s in lines)
    assert json.loads((out / "TRAINING.json").read_text())["devices"] == rec["devices"]
    assert not (out / "ckpt.pt").exists()


def test_a_pause_asked_for_in_the_last_step_finishes_the_phase_and_says_so(tmp_path):
    def pause_in_last_step(s):
        if s.startswith('{"step": 2,'):
            os.kill(os.getpid(), signal.SIGTERM)

    rec = train(TrainConfig(log_every=1, **TINY), tmp_path / "m", log=pause_in_last_step)
    assert rec["stop_requested"] is True and rec["steps"] == 2
    on_disk = json.loads((tmp_path / "m" / "TRAINING.json").read_text())
    assert "stop_requested" not in on_disk and on_disk["model_safetensors_sha256"] == rec["model_safetensors_sha256"]
    assert not (tmp_path / "m" / "ckpt.pt").exists() and not (tmp_path / "m" / "TRAINING.json.tmp").exists()


def test_a_broken_worker_pool_falls_back_to_the_same_records_inline():
    import types
    from concurrent.futures.process import BrokenProcessPool

    from kvtier.models.reasoner import build_reasoner_tokenizer, reasoner_config
    from kvtier.models.reasoner_data import make_batch, step_problems
    from kvtier.models.train_eviction import DeathsAhead, EvictMix, deaths_for

    mix, tok, cfg = EvictMix.parse("random:128:32", 0.0), build_reasoner_tokenizer(), reasoner_config("base")
    batches = {s: make_batch(tok, step_problems(3, s, 2, set()), tok.pad_token_id) for s in range(3)}
    inputs = lambda s: [(mix.assign(3, s, "0", 2), batches[s][1])]            # noqa: E731
    lines = []
    ahead = DeathsAhead(mix, cfg, inputs, workers=1, log=lines.append)
    ahead.pool.shutdown()

    class Broken:
        def result(self):
            raise BrokenProcessPool("a worker was killed")

    ahead.pool = types.SimpleNamespace(submit=lambda *a, **k: Broken(), shutdown=lambda **k: None)
    model = types.SimpleNamespace(config=cfg)
    for s in range(3):
        got = ahead.get(s, 0, 3)["kvtier_deaths"]
        assert torch.equal(got, deaths_for(mix, inputs(s)[0][0], batches[s][1], model)["kvtier_deaths"])
    assert ahead.broken and len(lines) == 1 and "inline" in lines[0]


def test_evictions_simulated_ahead_in_workers_give_the_same_weights(tmp_path):
    ev = dict(evict="random:128:32", full_share=0.0, short_batch=1, **{**TINY, "batch": 2})
    inline = train(TrainConfig(**ev), tmp_path / "inline", log=lambda s: None)
    ahead = train(TrainConfig(workers=1, **ev), tmp_path / "ahead", log=lambda s: None)   # one process: the same path
    assert ahead["speed"]["workers"] == 1
    assert ahead["model_safetensors_sha256"] == inline["model_safetensors_sha256"]
    assert inline["held_out_teacher_forced"]["local_random_K128"] == ahead["held_out_teacher_forced"]["local_random_K128"]


def test_cuda_asked_for_where_there_is_none_is_refused_by_name(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="device 'cuda'"):
        train(TrainConfig(device="cuda", **TINY), tmp_path / "m", log=lambda s: None)


def test_every_recipe_names_known_families_and_trainconfig_fields():
    from dataclasses import fields

    from kvtier.tasks.chains import FAMILIES

    names = {f.name for f in fields(TrainConfig)}
    for r in RECIPES.values():
        assert r["family"] in FAMILIES
        for ph in r["phases"]:
            assert set(ph.params) <= names, ph


def test_the_documented_gpu_box_entry_point_runs(tmp_path):
    """docs/reasoner.md's GPU command: `python3 -m kvtier.models.cli train-recipe` from the source tree, no kvtier
    install (what a GPU box with torch, transformers and typer has); a bad phase is refused before training."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    r = subprocess.run([sys.executable, "-m", "kvtier.models.cli", "train-recipe", "--shape", "long-8kv", "--work",
                        str(tmp_path / "w"), "--device", "cuda", "--workers", "6", "--through", "p9"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "p9" in r.stderr and "evict" in r.stderr, r.stderr
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reasoner.md").read_text()
    assert "python3 -m kvtier.models.cli train-recipe" in doc and "--workers 6" in doc
