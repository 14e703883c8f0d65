"""Run a `kvtier.benchmarks.gpu_*` launcher as a lent GPU machine runs it: `PYTHONPATH=src`, with vLLM,
pydantic, typer and Ray unimportable and kvtier not installed (it must come from the checkout's src/)."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_on_bare_torch(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    code = ("import sys, runpy\n"
            "for m in ('vllm', 'pydantic', 'typer', 'ray'): sys.modules[m] = None\n"
            f"sys.argv = [{module!r}] + {argv!r}\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
            "import kvtier\n"
            f"assert kvtier.__file__ == {str(SRC / 'kvtier' / '__init__.py')!r}, kvtier.__file__\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
