"""`kvtier model train-reasoner --dtype auto|float32|bfloat16` (issue #36): auto is float32 on a CPU
without native bf16 (no AVX512-BF16, no AMX: kvtier.engine.cpu_dtype's flags, the serving side's detector),
bfloat16 on AVX512-BF16/AMX CPUs and on CUDA; an explicit dtype wins; TRAINING.json records the
resolved dtype, why, and the steps per second. No timing is asserted."""

import json

import pytest

from kvtier.engine import cpu_dtype
from kvtier.models.reasoner_train import train
from kvtier.models.train_config import TrainConfig, resolve_dtype, saved_config

AVX2 = {"fpu", "sse2", "avx", "avx2", "fma"}
AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}


@pytest.mark.parametrize("flags, requested, device, want", [
    (AVX2, "auto", "cpu", "float32"),           # emulated bf16: float32
    (AMX, "auto", "cpu", "bfloat16"),
    (AVX512_BF16, "auto", "cpu", "bfloat16"),
    (set(), "auto", "cpu", "float32"),          # no /proc/cpuinfo to tell: never the emulated trap
    (AVX2, "auto", "cuda", "bfloat16"),         # the GPU's, whatever the host CPU
    (AVX2, "bfloat16", "cpu", "bfloat16"),      # an explicit dtype wins
    (AMX, "float32", "cpu", "float32"),
    (AMX, "float32", "cuda", "float32"),
])
def test_auto_resolution_reads_the_cpu_flags(monkeypatch, flags, requested, device, want):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: set(flags))
    dtype, why = resolve_dtype(requested, device)
    assert dtype == want and why
    assert ("given" in why) == (requested != "auto")
    assert resolve_dtype(requested, device, flags=set(flags))[0] == want     # the same from explicit flags
    # an explicit bf16 on a CPU that emulates it is honoured and says so (a recipe's resumed steps may land there)
    assert ("given; this CPU" in why) == (requested == "bfloat16" and device == "cpu" and flags == AVX2)


def test_a_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        resolve_dtype("fp16")
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["model", "train-reasoner", "--dtype", "fp16"])
    assert r.exit_code == 2 and "--dtype" in r.output and "float32" in r.output, r.output


def test_training_json_records_the_resolved_dtype_and_the_speed(monkeypatch, tmp_path):
    tiny = dict(steps=2, batch=1, threads=1, held_out=1, warmup=1)
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: set(AVX2))
    rec = train(TrainConfig(**tiny), tmp_path / "auto", log=lambda s: None)
    on_disk = json.loads((tmp_path / "auto" / "TRAINING.json").read_text())
    assert on_disk["dtype"] == rec["dtype"]
    assert rec["dtype"]["requested"] == "auto" and rec["dtype"]["resolved"] == "float32"
    assert "AVX512-BF16" in rec["dtype"]["reason"] and rec["config"]["dtype"] == "auto"
    assert "--dtype float32" in rec["command"]                  # the command reproduces the weights anywhere
    speed = rec["speed"]
    assert speed["steps"] == 2 and speed["dtype"] == "float32" and speed["steps_per_second"] > 0
    assert speed["seconds_per_step_median"] > 0 and speed["family"] == "chains"
    # the explicit float32 run is the same computation, so the same weights
    same = train(TrainConfig(dtype="float32", **tiny), tmp_path / "f32", log=lambda s: None)
    assert same["model_safetensors_sha256"] == rec["model_safetensors_sha256"]
    assert same["dtype"]["reason"] == "--dtype float32 given"
    # on an AMX CPU auto is bf16 autocast: other weights
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: set(AMX))
    bf = train(TrainConfig(**tiny), tmp_path / "amx", log=lambda s: None)
    assert bf["dtype"]["resolved"] == "bfloat16" and "--dtype bfloat16" in bf["command"]
    assert bf["model_safetensors_sha256"] != rec["model_safetensors_sha256"]


def test_a_model_without_the_positions_is_refused_and_old_checkpoints_resume(tmp_path):
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        train(TrainConfig(steps=1, batch=1, threads=1, family="chains-long"), tmp_path / "long", log=lambda s: None)
    assert not (tmp_path / "long" / "TRAINING.json").exists()
    # a checkpoint written before #36 (bf16 true/false, no family) reads as today's fields
    old = {**{k: v for k, v in vars(TrainConfig()).items() if k not in ("dtype", "family")}, "bf16": True}
    assert saved_config(old) == {**vars(TrainConfig()), "dtype": "bfloat16"}
    assert saved_config({**old, "bf16": False})["dtype"] == "float32"
