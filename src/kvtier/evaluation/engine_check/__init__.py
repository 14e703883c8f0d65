"""`kvtier engine check`: the engine's exactness and memory checks, run on the machine and with the engine
configuration that will serve (device, dtype, CUDA-graph mode, tensor parallelism, prefix caching, async
scheduling: whatever the configuration resolves to), with a small model by default.

Each check can fail: `checks.py` says what it asserts and which fault it catches; tests/test_engine_check.py
plants those faults. `runner.run_engine_check` builds the engine and runs them; `target.py` resolves what to
build from a service config or a model and vLLM arguments.
"""

from .results import CheckResult, Report
from .runner import CHECKS, run_engine_check

__all__ = ["CHECKS", "CheckResult", "Report", "run_engine_check"]
