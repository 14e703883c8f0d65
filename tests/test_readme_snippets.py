"""The README's Python, pasted into a script as a new user would: every ```python block runs as written, in
a fresh process with no kvtier- or test-specific environment (vLLM's multiprocess engine, no
VLLM_ALLOW_INSECURE_SERIALIZATION), and the eviction counters it prints show eviction happened."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.engine


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_to_run():
    assert python_blocks()


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_runs_as_written(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(python_blocks()[index])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"))}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("{")]   # vLLM logs to stdout too
    engine = ast.literal_eval(printed[-1])
    assert engine["events"] > 0 and engine["tokens_evicted"] > 0
