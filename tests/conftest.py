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
