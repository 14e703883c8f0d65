"""`kvtier eval reasoner --dtype`: auto runs float32 on a CPU without native bf16 (vLLM's bf16 matmuls take
torch's ~70x slower fallback there) and the models' bfloat16 elsewhere; bench rl's held-out evaluation pins
bfloat16 so a series resumed on another CPU evaluates alike."""

import pytest
from typer.testing import CliRunner

from kvtier.evaluation import reasoner_eval
from kvtier.evaluation.reasoner_eval import ReasonerEvalConfig, engine_dtype


@pytest.mark.parametrize("flags, expected", [({"avx2", "avx512f"}, "float32"), ({"avx2", "avx512_bf16"}, "bfloat16"),
                                             ({"amx_bf16"}, "bfloat16")])
def test_auto_follows_the_cpus_native_bf16(monkeypatch, flags, expected):
    import kvtier.engine.cpu_dtype as cd

    monkeypatch.setattr(cd, "cpu_flags", lambda: set(flags))
    lines = []
    assert engine_dtype("auto", log=lines.append) == expected
    assert len(lines) == (expected == "float32")          # one line says why, only when it is not the default
    assert engine_dtype("bfloat16", log=lines.append) == "bfloat16" and engine_dtype("float32") == "float32"


def test_a_bad_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="dtype must be one of"):
        ReasonerEvalConfig(dtype="fp8")
    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "reasoner", "--dtype", "fp8", "--out", "/nonexistent/never-written"])
    assert res.exit_code == 2 and "dtype" in res.output


def test_bench_rl_heldout_pins_its_dtype(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from kvtier.benchmarks import rl_heldout

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        raise RuntimeError("stop here")

    monkeypatch.setattr(rl_heldout.subprocess, "run", fake_run)
    shape = SimpleNamespace(heldout=2, budget=512, buffer=32, family="chains")
    with pytest.raises(RuntimeError, match="stop here"):
        rl_heldout.heldout_accuracy("/m", shape, tmp_path)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--dtype") + 1] == rl_heldout.HELDOUT_DTYPE == "bfloat16"
    assert reasoner_eval.DTYPES == ("auto", "bfloat16", "float32")
