"""Shared fixtures. vLLM engines run in-process (no engine-core subprocess) so tests can reach the
scheduler and worker, and are shared per session: each start costs seconds and ~1-3 GB."""

import atexit
import faulthandler
import gc
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# -- a clean exit (issue #61: `make test` printed its green summary, then the process died of SIGSEGV) --------
# What the tests leave behind is stopped at the session's end, while the interpreter is whole: Ray (a module
# that fails in its fixture's setup may leave it initialized) and the in-process vLLM engines of finished
# modules (kept alive by reference cycles until a collection: otherwise destroyed during the interpreter's
# finalization, in whatever order it tears modules down). One thing cannot be stopped: Ray's C++ core starts
# native threads in the driver that ray.shutdown() leaves running (Ray 2.60; seen with gdb after
# test_rollout.py and test_service_readiness_live.py: the GCS client's io_service "gcs_client_io_s", the core
# worker's "worker.io" thread pool, OpenCensus's stats harvester, gRPC's event engine and timer threads). They keep
# running through the interpreter's finalization and the C++ static destructors exit() runs, whose objects
# they use. So once the session is over and every atexit handler has run, a process with such threads ends
# with os._exit(its exit status) instead of finalizing: nothing of the tests' is left to do by then.
RAY_NATIVE_THREADS = ("gcs_client_io_s", "worker.io")   # Ray's own names (the others' are gRPC's or unnamed)
_EXIT: dict = {}


def native_threads() -> list[str]:
    """The names of this process's threads (native ones included: /proc/self/task/*/comm)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:   # exited meanwhile
            pass
    return names


def stop_leftovers() -> list[str]:
    """Shut Ray down if a test left it initialized and collect the engines of finished modules; the Ray
    native threads still running afterwards."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    gc.collect()
    return [n for n in native_threads() if n.startswith(RAY_NATIVE_THREADS)]


def _exit_without_finalizing() -> None:
    """The last atexit handler (registered before the tests import Ray, vLLM or torch, whose handlers run
    first): end the process before the interpreter's finalization when Ray's native threads are running."""
    status = _EXIT.get("status")
    if status is None or not [n for n in native_threads() if n.startswith(RAY_NATIVE_THREADS)]:
        return
    import logging

    logging.shutdown()   # atexit's first handler, which would otherwise run after this one
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or replaced
            pass
    os._exit(int(status))


def pytest_configure(config):
    atexit.register(_exit_without_finalizing)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    left = stop_leftovers()
    _EXIT["status"] = int(exitstatus)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if left and reporter is not None:
        reporter.write_line(f"\nRay's native threads still running after ray.shutdown(): "
                            f"{', '.join(sorted(set(left)))}; the process will end without finalizing (tests/conftest.py)")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # pytest's faulthandler plugin has just disabled the handler: a crash at exit would print nothing but the
    # shell's "Segmentation fault"; with it every thread's stack is written to stderr
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


@pytest.fixture(scope="session")
def tiny_model_dir():
    from kvtier.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """Benchmarks set torch's CPU thread count (single-threaded by default); an in-process vLLM engine built
    later in the same process would inherit it, and its kernels' summation order with it (greedy
    near-ties then differ from a stock engine run in a fresh process)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def single_torch_thread():
    """torch on one CPU thread for the module (reference computations; restored by the fixture above)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The reference engine (transformers, float32, CPU) on the tiny model."""
    import torch

    from kvtier.reference import ReferenceEngine

    return ReferenceEngine(tiny_model_dir, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def replay(tiny_model_dir):
    """The masked-attention oracle (transformers) on the tiny model."""
    from kvtier.reference import MaskedReplay

    return MaskedReplay(tiny_model_dir)
