"""Shared fixtures. vLLM engines run in-process (no engine-core subprocess) so tests can reach the
scheduler and worker, and are shared per session: each start costs seconds and ~1-3 GB."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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
