"""`kvtier engine check`: the engine's exactness and memory checks, run on the machine and with the engine
configuration that will serve (device, dtype, CUDA-graph mode, tensor parallelism, prefix caching, async
scheduling: whatever the configuration resolves to), with a small model by default.

Each check can fail: `checks.py` says what it asserts and which fault it catches; tests/test_engine_check.py
plants those faults. `runner.run_engine_check` builds the engine and runs them; `target.py` resolves what to
build from a service config or a model and vLLM arguments.
"""

__all__ = ["CHECKS", "CheckResult", "Report", "run_engine_check"]


def __getattr__(name: str):
    """Loaded on first use: the checks import vLLM, and `kvtier --help` imports this package's cli."""
    if name in ("CHECKS", "run_engine_check"):
        from . import runner

        return getattr(runner, name)
    if name in ("CheckResult", "Report"):
        from . import results

        return getattr(results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
