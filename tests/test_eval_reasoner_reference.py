"""`kvtier eval reasoner --engine reference`: the grid on kvtier.reference (transformers, the engine's schedule and
keyed keep-sets), for a box without vLLM (docs/gpu-train-long.sh runs it on a GPU after training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.evaluation.reasoner_eval import ReasonerEvalConfig, run_reasoner_eval
from kvtier.models.reasoner import REASONER_EVICT_DIR

SRC = Path(__file__).resolve().parents[1] / "src"


def test_an_unknown_engine_is_refused_by_name(tmp_path):
    from kvtier.cli import app

    with pytest.raises(ValueError, match="engine"):
        ReasonerEvalConfig(engine="sglang")
    r = CliRunner().invoke(app, ["eval", "reasoner", "--engine", "sglang", "--out", str(tmp_path / "e")])
    assert r.exit_code == 2 and "--engine" in r.output and "reference" in r.output, r.output
    assert not (tmp_path / "e").exists()


@pytest.mark.skipif(not (REASONER_EVICT_DIR / "model.safetensors").exists(), reason="no shipped reasoner-evict")
def test_the_reference_engine_grades_the_shipped_model(tmp_path):
    cfg = ReasonerEvalConfig(problems=2, runs=1, policies=("random",), budgets=(512,), kinds=("local",),
                             model=str(REASONER_EVICT_DIR), engine="reference", dtype="float32")
    res = run_reasoner_eval(cfg, tmp_path)
    assert res["config"]["engine"] == "reference" and res["config"]["device"] in ("cpu", "cuda")
    rows = [json.loads(line) for line in (tmp_path / "instances.jsonl").read_text().splitlines()]
    assert {r["engine"] for r in rows} == {"reference"} and len(rows) == 4
    assert res["full_accuracy"]["local"] == 1.0                        # the shipped model's full attention: 64/64
    random = [r for r in rows if r["policy"] == "random"]
    assert all(r["rounds"] > 0 for r in random)                        # eviction happened


def test_the_documented_gpu_box_entry_point_exists():
    """docs/gpu-train-long.sh runs the grid as `python3 -m kvtier.evaluation.reasoner_cli reasoner ...`."""
    r = subprocess.run([sys.executable, "-m", "kvtier.evaluation.reasoner_cli", "reasoner", "--help"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0 and "--engine" in r.stdout and "--max-batch" in r.stdout, r.stderr
    script = (SRC.parent / "docs" / "gpu-train-long.sh").read_text()
    assert "-m kvtier.evaluation.reasoner_cli reasoner --engine reference" in script
    assert "-m kvtier.models.cli train-recipe" in script
