"""bfloat16 on a CPU without AVX512-BF16/AMX (engine/cpu_dtype.py): `kvtier serve` says so with the fix, and
`kvtier bench serve --dtype` gives every arm one dtype or refuses a bad one before any server starts."""

import pytest

from kvtier.engine.cpu_dtype import bf16_slow_path_note

AVX2 = {"fpu", "avx", "avx2", "fma"}


@pytest.mark.parametrize("dtype, accelerator, flags, says", [
    (None, "cpu", AVX2, True),                       # the model's dtype, bfloat16 (given, not auto)
    ("bfloat16", "cpu", AVX2, True),
    ("float32", "cpu", AVX2, False),
    ("bfloat16", "cpu", AVX2 | {"avx512f", "avx512_bf16"}, False),
    ("bfloat16", "cpu", AVX2 | {"amx_bf16", "amx_tile"}, False),
    ("bfloat16", "gpu", AVX2, False),
    ("bfloat16", "cpu", set(), False),                # no /proc/cpuinfo: nothing to tell
])
def test_bf16_slow_path_note(dtype, accelerator, flags, says):
    note = bf16_slow_path_note(dtype, accelerator, flags)
    assert (note is not None) == says
    if says:
        assert "engine_kwargs.dtype: float32" in note and "kv_cache_bytes" in note


def test_bench_serve_refuses_a_bad_dtype_before_any_server_starts(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["bench", "serve", "--arms", "stock", "--workloads", "idle", "--dtype", "fp8",
                                 "--workdir", str(tmp_path / "work")])
    assert r.exit_code == 2 and "--dtype" in r.output and "float32" in r.output, r.output
    assert not (tmp_path / "work").exists()


def test_every_arm_gets_the_dtype(tmp_path, monkeypatch):
    from kvtier.benchmarks.serve import kvtier_config
    from kvtier.benchmarks.serve_cli import engine_settings
    from kvtier.service.config import DEFAULT_CONFIG

    cfg, settings = engine_settings(None, "8MiB", None, None, dtype="float32")
    assert settings.dtype == "float32"
    assert settings.vllm_cli()[settings.vllm_cli().index("--dtype") + 1] == "float32"     # stock vLLM's server
    assert settings.engine_kwargs()["dtype"] == "float32"                                  # Ray Serve LLM's
    eng = kvtier_config(cfg.model_dump(mode="json"), settings)["engines"]["cpu"]          # kvtier's
    assert eng["engine_kwargs"]["dtype"] == "float32" and eng["kv_cache_bytes"] == 8 << 20
    # `max_num_seqs: auto` sized at 4 bytes per value: 8 MiB = 16 blocks, 2 per k128 request
    assert settings.max_num_seqs == 8
    # the default, dtype auto: the model's bfloat16 where the CPU computes it natively, else float32
    monkeypatch.setattr("kvtier.engine.cpu_dtype.cpu_flags", lambda: AVX2 | {"amx_bf16"})
    assert engine_settings(DEFAULT_CONFIG, "8MiB", None, None)[1].dtype == "bfloat16"
    monkeypatch.setattr("kvtier.engine.cpu_dtype.cpu_flags", lambda: AVX2)
    assert engine_settings(DEFAULT_CONFIG, "8MiB", None, None)[1].dtype == "float32"
