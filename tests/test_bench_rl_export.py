"""`kvtier bench rl-export` (issue #59 item 6): the run that ended best, as a model directory the service config
loads, its weights equal to the run's final checkpoint in bf16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtier.benchmarks.rl_export import best_seed, export_run
from kvtier.benchmarks.rl_store import keep

START = Path(__file__).resolve().parents[1] / "train" / "long-8kv" / "p5"   # a committed reasoner (1.2M params)


def _end(evicted: float, full: float) -> dict:
    return {"start": {}, "end": {"evicted": {"accuracy": evicted, "ci": [0, 1]}, "full": {"accuracy": full, "ci": [0, 1]}}}


def test_best_seed_is_the_best_end_under_eviction_then_full_then_the_lower_seed():
    runs = {s: {"run": {"heldout": _end(e, f)}} for s, e, f in ((0, 0.4, 0.9), (1, 0.5, 0.8), (2, 0.5, 0.95), (3, 0.5, 0.95))}
    assert best_seed(runs) == 2
    with pytest.raises(ValueError, match="no finished run"):
        best_seed({})


def test_export_writes_a_servable_model_of_the_best_runs_checkpoint(tmp_path):
    if not (START / "model.safetensors").exists():
        pytest.skip("train/long-8kv/p5 not in this checkout")
    import torch
    from safetensors.torch import load_file

    from kvtier.service.config import load_config

    work = tmp_path / "w"
    for seed, evicted in ((0, 0.3), (1, 0.6)):
        hf = work / "replay" / f"seed{seed}" / "checkpoints" / "global_step_20" / "actor" / "huggingface"
        shutil.copytree(START, hf, ignore=shutil.ignore_patterns("*.json", "*.md"))
        config = json.loads((START / "config.json").read_text())      # verl writes no tokenizer files: copied;
        config["attn_implementation"] = "kvtier_deathtime"             # the learner's attention, unknown here
        (hf / "config.json").write_text(json.dumps(config))
        keep(work / "replay" / f"seed{seed}.json", {"arm": "replay", "steps": 20, "model": str(START)},
             {"seed": seed, "heldout": _end(evicted, 1.0), "train_seconds": 10.0})
    out = tmp_path / "export"
    meta = export_run(work, "replay", out)
    assert meta["seed"] == 1 and meta["chosen_by"] == "best_seed" and meta["heldout"]["end"]["evicted"]["accuracy"] == 0.6
    exported, start = load_file(str(out / "model.safetensors")), load_file(str(START / "model.safetensors"))
    assert set(exported) == set(start) and all(exported[k].dtype == torch.bfloat16 for k in exported)
    assert all(torch.equal(exported[k], start[k].to(torch.bfloat16)) for k in start)
    assert json.loads((out / "EXPORT.json").read_text())["model_id"] == "kvtier-rl-replay-seed1"
    cfg = load_config(out / "service.yaml")                               # the service's own validation
    (engine,) = cfg.engines.values()
    assert Path(engine.model) == out.resolve() and engine.model_id == "kvtier-rl-replay-seed1"
    with pytest.raises(ValueError, match="seed 5"):
        export_run(work, "replay", tmp_path / "x", seed=5)
    keep(work / "replay" / "seed2.json", {"arm": "replay", "steps": 20, "model": str(START), "lr": 1.0},
         {"seed": 2, "heldout": _end(0.9, 1.0)})                # another series' run in the same workdir
    with pytest.raises(ValueError, match="different lr"):
        export_run(work, "replay", tmp_path / "y")
