"""Issue #25: an allowlist of tested engine configurations (src/kvtier/engine/allowlist.py). Every value is
forced on a real CPU `VllmConfig` (or on the worker's inputs), as tests/test_engine_guards.py does; no
engine starts."""

import weakref
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from test_engine_guards import make_config  # noqa: E402

from kvtier.engine import allowlist  # noqa: E402
from kvtier.engine.allowlist_fields import CHECKED, NEUTRAL, unclassified  # noqa: E402
from kvtier.engine.support import KVTierRequestError, UnsupportedEngineConfig, check_supported  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugin():
    from kvtier.engine.plugin import register

    register()


@pytest.fixture
def config(tiny_model_dir):
    return make_config(tiny_model_dir, kvtier={})


def test_every_vllm_config_field_is_classified():
    """A field the pinned vLLM adds (or renames) must be classified before it can pass silently."""
    assert unclassified() == []
    assert not CHECKED & set(NEUTRAL)


def test_the_tiny_cpu_config_is_on_the_table(config):
    assert allowlist.violations(config) == []
    check_supported(config)
    config.cache_config.enable_prefix_caching = True    # prefix caching is on the table (#26)
    assert allowlist.violations(config) == []


@pytest.mark.parametrize("path, value, named", [
    ("parallel_config.decode_context_parallel_size", 2, "decode_context_parallel_size=2"),
    ("parallel_config.prefill_context_parallel_size", 2, "prefill_context_parallel_size=2"),
    ("parallel_config.pipeline_parallel_size", 2, "pipeline_parallel_size=2"),
    ("parallel_config.tensor_parallel_size", 4, "tensor_parallel_size=4 > the model's 2 KV heads"),
    ("parallel_config.enable_dbo", True, "enable_dbo=True"),
    ("cache_config.kv_offloading_size", 4.0, "kv_offloading_size=4.0"),
    ("model_config.disable_cascade_attn", False, "disable_cascade_attn=False"),
    ("cache_config.cache_dtype", "fp8", "cache_dtype='fp8'"),
    ("cache_config.kv_sharing_fast_prefill", True, "kv_sharing_fast_prefill=True"),
    ("scheduler_config.scheduler_cls", "my.Scheduler", "scheduler_cls='my.Scheduler'"),
])
def test_settings_off_the_table_are_refused_by_name(config, path, value, named):
    owner, field = path.rsplit(".", 1)
    setattr(allowlist._get(config, owner), field, value)
    with pytest.raises(UnsupportedEngineConfig, match="cannot run with") as exc:
        check_supported(config)
    assert named in str(exc.value) and "kvtier engine supported" in str(exc.value)


def test_a_kv_connector_is_refused(config):
    from vllm.config import KVTransferConfig

    config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(UnsupportedEngineConfig, match="kv_transfer_config=.*KV connector"):
        check_supported(config)


def test_every_violation_is_named_in_one_message(config):
    config.parallel_config.decode_context_parallel_size = 2
    config.cache_config.kv_offloading_size = 1.0
    config.speculative_config = SimpleNamespace(method="ngram")
    with pytest.raises(UnsupportedEngineConfig) as exc:
        check_supported(config)
    msg = str(exc.value)
    assert msg.count("; ") >= 2 and all(s in msg for s in ("decode_context", "kv_offloading", "speculative"))


def test_head_dim_past_the_layout_probe_is_refused_by_name(config, monkeypatch):
    monkeypatch.setattr(type(config.model_config), "get_head_size", lambda self: 256)
    with pytest.raises(UnsupportedEngineConfig, match="head_dim=256"):
        check_supported(config)


def test_without_kvtier_nothing_is_checked(tiny_model_dir):
    config = make_config(tiny_model_dir)
    config.parallel_config.decode_context_parallel_size = 2
    check_supported(config)


def test_worker_checks_name_the_backend_and_the_kernel_block_size():
    assert allowlist.worker_violations("CPU_ATTN", [128], 128) == []
    assert allowlist.worker_violations("FLASH_ATTN", [16], 16) == []
    (msg,) = allowlist.worker_violations("FLASHINFER", [16], 16)
    assert "attention backend FLASHINFER" in msg and "attention_config.backend" in msg
    (msg,) = allowlist.worker_violations("FLASH_ATTN", [64], 256)
    assert "kernel block size [64]" in msg and "block_size 256" in msg


def test_model_runner_v2_features_say_kvtier_refuses_the_advice(tiny_model_dir):
    """vLLM answers a V2-only feature with 'set VLLM_USE_V2_MODEL_RUNNER=1'; with kvtier that advice is no
    way out, and the one message says both."""
    with pytest.raises(UnsupportedEngineConfig) as exc:
        make_config(tiny_model_dir, kvtier={}, enable_return_routed_experts=True)
    msg = str(exc.value)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in msg and "refuses" in msg and "kvtier eviction" in msg


def test_prompt_logprob_token_ids_request_says_kvtier_refuses_the_advice(config):
    from vllm import SamplingParams

    from kvtier.engine import patch_frontend

    def vllm_process_inputs(self, *a, **k):   # what vLLM 0.31's InputProcessor raises on the V1 runner
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError("prompt_logprob_token_ids requires the V2 model runner "
                                  "(VLLM_USE_V2_MODEL_RUNNER=1).", parameter="prompt_logprob_token_ids")

    wrapped = patch_frontend.process_inputs(vllm_process_inputs)
    with pytest.raises(KVTierRequestError, match="refuses VLLM_USE_V2_MODEL_RUNNER=1") as exc:
        wrapped(SimpleNamespace(vllm_config=config), "r0", "hi", SamplingParams())
    assert exc.value.parameter == "prompt_logprob_token_ids"


def test_the_profiling_kv_cache_gets_no_worker_eviction(config):
    """vLLM initialises a throw-away cache for the CUDA-graph memory profile (is_profiling=True): kvtier
    builds nothing on it, so nothing of kvtier's keeps that buffer alive."""
    import torch

    from kvtier.engine import patch_worker

    profiling_cache = torch.empty(1024)
    ref = weakref.ref(profiling_cache)
    runner = SimpleNamespace(vllm_config=config)

    def vllm_initialize_kv_cache(self, kv_cache_config, is_profiling=False):
        self.cache = profiling_cache if is_profiling else None

    patch_worker.initialize_kv_cache(vllm_initialize_kv_cache)(runner, object(), is_profiling=True)
    assert runner.kvtier is None
    runner.cache = None
    del profiling_cache
    assert ref() is None


def test_supported_command_prints_the_table():
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["engine", "supported"])
    assert r.exit_code == 0 and r.output == allowlist.markdown()
    assert all(f"`{row.setting}`" in r.output for row in allowlist.TESTED)


def test_the_docs_gpu_section_is_the_generated_table():
    """docs/engine.md's table is `kvtier engine supported --docs docs/engine.md`'s output, not hand-kept."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    block = text.split(allowlist.BEGIN, 1)[1].split("\n", 1)[1].split(allowlist.END, 1)[0]
    assert block == allowlist.markdown(), "run: kvtier engine supported --docs docs/engine.md"
