"""Issue #12 item 1, "never silently wrong": with kvtier eviction configured, a GPU default that kvtier is
not tested with is refused at start-up (naming the setting) or overridden with one WARNING line.

The GPU defaults are simulated on CPU by forcing what the GPU platform would set on a real `VllmConfig`
(Triton present -> Model Runner V2; cudagraph_mode FULL_AND_PIECEWISE), so no engine starts except in the
last test."""

import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm.config.vllm as vllm_config_mod  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

from kvtier.engine import patch_worker  # noqa: E402
from kvtier.engine.support import (KVTierRequestError, UnsupportedEngineConfig, check_supported,  # noqa: E402
                                   validate_engine_request)

KVTIER_LOGGER = "kvtier.engine"


@pytest.fixture(scope="module", autouse=True)
def plugin():
    from kvtier.engine.plugin import register

    register()  # what vLLM's entry point does in each of its processes


@pytest.fixture
def no_v2_env(monkeypatch):
    import vllm.envs

    # an engine built earlier in this process (another test file's) turned on vLLM's env cache, which
    # would hide the env this test sets
    vllm.envs.disable_envs_cache()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(patch_worker, "_V1_FORCED_LOGGED", False)


def make_config(tiny_model_dir, kvtier=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    extra = {} if kvtier is None else {"additional_config": {"kvtier": kvtier}}
    return EngineArgs(model=tiny_model_dir, max_model_len=512, enable_prefix_caching=False, enforce_eager=True,
                      **extra, **kwargs).create_engine_config()


def vllm_would_pick(config) -> bool:
    """What stock vLLM's property answers (the original fget kept by install())."""
    return type(config).use_v2_model_runner.__kvtier_original__.fget(config)


def kvtier_records(caplog):
    return [r for r in caplog.records if r.name == KVTIER_LOGGER and "V1 model runner" in r.getMessage()]


# -- Model Runner V2 ------------------------------------------------------------------------------------
def test_property_is_patched_and_install_is_idempotent():
    from kvtier.engine.patches import install

    prop = vllm_config_mod.VllmConfig.__dict__["use_v2_model_runner"]
    assert isinstance(prop, property) and prop.__kvtier_patched__
    assert isinstance(prop.__kvtier_original__, property)
    install()
    assert vllm_config_mod.VllmConfig.__dict__["use_v2_model_runner"] is prop


def test_gpu_default_v2_is_overridden_to_v1_with_one_warning(tiny_model_dir, monkeypatch, no_v2_env, caplog):
    config = make_config(tiny_model_dir, kvtier={})
    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)  # what a GPU host has
    assert vllm_would_pick(config) is True, "the simulation must make stock vLLM pick V2"
    with caplog.at_level(logging.WARNING, logger=KVTIER_LOGGER):
        assert config.use_v2_model_runner is False
        assert config.use_v2_model_runner is False  # read again (scheduler, worker, frontend): no new line
    recs = kvtier_records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert "Model Runner V2" in recs[0].getMessage() and "additional_config.kvtier" in recs[0].getMessage()


def test_no_log_when_vllm_picks_v1_anyway(tiny_model_dir, monkeypatch, no_v2_env, caplog):
    config = make_config(tiny_model_dir, kvtier={})
    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", False)
    with caplog.at_level(logging.WARNING, logger=KVTIER_LOGGER):
        assert config.use_v2_model_runner is False
    assert kvtier_records(caplog) == []


def test_explicit_v2_env_is_refused_naming_it(tiny_model_dir, monkeypatch, no_v2_env):
    config = make_config(tiny_model_dir, kvtier={})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert config.use_v2_model_runner is True  # not overridden: refused (below, and in Scheduler.__init__)
    with pytest.raises(UnsupportedEngineConfig, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        check_supported(config)
    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)  # on CPU vLLM itself refuses V2 without Triton
    with pytest.raises(UnsupportedEngineConfig, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        make_config(tiny_model_dir, kvtier={})  # at start-up, in the caller's process
    make_config(tiny_model_dir)  # a plain engine is vLLM's business


def test_explicit_v1_env_is_accepted_silently(tiny_model_dir, monkeypatch, no_v2_env, caplog):
    config = make_config(tiny_model_dir, kvtier={})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)
    with caplog.at_level(logging.WARNING, logger=KVTIER_LOGGER):
        assert config.use_v2_model_runner is False
    assert kvtier_records(caplog) == []
    check_supported(config)


@pytest.mark.parametrize("field, match", [("hisparse", "hisparse_config"), ("watermark", "watermark_config")])
def test_features_that_force_v2_are_refused(tiny_model_dir, monkeypatch, no_v2_env, field, match):
    config = make_config(tiny_model_dir, kvtier={})
    if field == "hisparse":
        monkeypatch.setattr(config, "attention_config", SimpleNamespace(hisparse_config=object()))
    else:
        monkeypatch.setattr(config, "watermark_config", object(), raising=False)
    assert config.use_v2_model_runner is True  # vLLM's answer (the feature needs V2), not overridden ...
    with pytest.raises(UnsupportedEngineConfig, match=match):
        check_supported(config)  # ... but refused


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_without_kvtier_the_property_is_vllms(tiny_model_dir, monkeypatch, no_v2_env, caplog, env):
    config = make_config(tiny_model_dir)
    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)
    with caplog.at_level(logging.WARNING, logger=KVTIER_LOGGER):
        assert config.use_v2_model_runner is vllm_would_pick(config)
        assert config.use_v2_model_runner is {None: True, "1": True, "0": False}[env]
    assert kvtier_records(caplog) == []
    disabled = make_config(tiny_model_dir, kvtier={"enabled": False})
    assert disabled.use_v2_model_runner is vllm_would_pick(disabled)


# -- CUDA graphs ----------------------------------------------------------------------------------------
FULL_MODES = [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY]


def with_graphs(config, mode, monkeypatch, splitting_ops=None):
    """What the CUDA platform's defaults give (vLLM 0.31 -O2: FULL_AND_PIECEWISE; splitting_ops = the
    attention ops, CompilationConfig.set_splitting_ops_for_v1). enforce_eager left splitting_ops = []."""
    cc = config.compilation_config
    if splitting_ops is None:
        splitting_ops = list(type(cc)._attention_ops) + ["vllm::unified_kv_cache_update"]
    monkeypatch.setattr(cc, "cudagraph_mode", mode)
    monkeypatch.setattr(cc, "splitting_ops", splitting_ops)
    return config


def test_cpu_runs_without_cuda_graphs(tiny_model_dir):
    config = make_config(tiny_model_dir, kvtier={"default": {"policy": "snapkv"}})
    assert not config.compilation_config.cudagraph_mode  # NONE on CPU: nothing to guard
    check_supported(config)


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("policy, reads", [("snapkv", True), ("h2o", True), ("rkv", True), ("random", False),
                                           ("recency", False), ("triattention", False)])
def test_full_cuda_graphs_refuse_query_reading_default_policy(tiny_model_dir, monkeypatch, mode, policy, reads):
    config = with_graphs(make_config(tiny_model_dir, kvtier={"default": {"policy": policy}}), mode, monkeypatch)
    if reads:
        with pytest.raises(UnsupportedEngineConfig, match=f"cudagraph_mode={mode.name}") as exc:
            check_supported(config)
        assert "PIECEWISE" in str(exc.value) and "enforce_eager" in str(exc.value)
    else:
        check_supported(config)


def test_piecewise_graphs_keep_attention_outside(tiny_model_dir, monkeypatch):
    config = make_config(tiny_model_dir, kvtier={"default": {"policy": "snapkv"}})
    assert "vllm::unified_attention_with_output" in type(config.compilation_config)._attention_ops
    check_supported(with_graphs(config, CUDAGraphMode.PIECEWISE, monkeypatch))  # vLLM's default splitting
    # splitting_ops without attention puts attention inside the captured pieces: refused, naming it
    for ops in (["vllm::unified_kv_cache_update"], []):
        with_graphs(config, CUDAGraphMode.PIECEWISE, monkeypatch, splitting_ops=ops)
        with pytest.raises(UnsupportedEngineConfig, match="splitting_ops"):
            check_supported(config)


def request(extra_args, n_prompt=32):
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args),
                           prompt_token_ids=list(range(n_prompt)))


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda m: m.name)
def test_full_cuda_graphs_reject_query_reading_requests(tiny_model_dir, monkeypatch, mode):
    config = with_graphs(make_config(tiny_model_dir, kvtier={}), mode, monkeypatch)  # default policy random
    check_supported(config)
    validate_engine_request(config, request({"kvtier_budget": 64}))
    validate_engine_request(config, request({"kvtier_budget": 64, "kvtier_policy": "random"}))
    validate_engine_request(config, request({"kvtier_budget": "full", "kvtier_policy": "snapkv"}))  # no eviction
    for policy in ("snapkv", "h2o"):
        with pytest.raises(KVTierRequestError, match=f"cudagraph_mode={mode.name}") as exc:
            validate_engine_request(config, request({"kvtier_budget": 64, "kvtier_policy": policy}))
        assert exc.value.parameter == "kvtier_policy"


def test_request_guard_is_off_without_full_graphs(tiny_model_dir, monkeypatch):
    config = make_config(tiny_model_dir, kvtier={})
    validate_engine_request(config, request({"kvtier_budget": 64, "kvtier_policy": "snapkv"}))  # CPU: NONE
    with_graphs(config, CUDAGraphMode.PIECEWISE, monkeypatch)
    validate_engine_request(config, request({"kvtier_budget": 64, "kvtier_policy": "h2o"}))


# -- a real engine ---------------------------------------------------------------------------------------
def _runner_facts(worker, v1_cls):
    runner = worker.model_runner
    return isinstance(runner, v1_cls), type(runner).__module__ + "." + type(runner).__name__, \
        getattr(runner, "kvtier", None) is not None


@pytest.fixture(scope="module")
def engines():
    """Kept alive until the module ends (dropping an in-process engine tears down vLLM's process groups)."""
    return []


def test_real_engine_runs_v1_runner_with_kvtier_attached(tiny_model_dir, monkeypatch, no_v2_env, caplog, engines):
    """Stock vLLM would start CPU Model Runner V2 here (Triton reported present); kvtier starts the V1 runner
    it patches, says so once, and attaches its worker-side state."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvtier.engine.api import build_llm

    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=KVTIER_LOGGER):
        llm = build_llm(tiny_model_dir, eviction={}, kv_cache_bytes=16 << 20, max_model_len=512, enforce_eager=True)
    engines.append(llm)
    elapsed = time.monotonic() - t0
    [(is_v1, runner_type, attached)] = llm.collective_rpc(_runner_facts, args=(GPUModelRunner,))
    assert is_v1, runner_type  # the V1 runner (CPUModelRunner subclasses it); V2's runners do not
    assert attached
    assert len(kvtier_records(caplog)) == 1
    assert llm.llm_engine.vllm_config.use_v2_model_runner is False
    print(f"engine start {elapsed:.1f}s")


def test_a_round_dropped_by_a_preemption_gives_its_number_to_the_next():
    """vLLM may preempt a request in the step its round was planned: that round never runs, so the next round of
    the request takes its number (the keyed draw's round index = rounds applied, what a resumed segment's
    `rounds_before` records; a skipped number would make the learner re-derive other victims)."""
    from types import SimpleNamespace

    from kvtier.engine.config import EvictionSpec
    from kvtier.engine.payload import CompactionOp
    from kvtier.engine.scheduler_side import RequestEviction, SchedulerEviction

    side = SchedulerEviction(cfg=None, block_size=16, pool_blocks=64)
    spec = EvictionSpec(policy="random", budget=32, buffer=8)
    side.states["r"] = RequestEviction(spec=spec, prompt_len=8, max_blocks=4, rounds=3, compacted=True)
    side.pending["r"] = CompactionOp(req_id="r", old_len=40, new_len=32, keep_blocks=2, prompt_len=8, spec=spec,
                                     round=3, query_position=60)
    side.on_preempt(SimpleNamespace(request_id="r"))
    assert side.states["r"].rounds == 2 and "r" not in side.pending and "r" in side.preempted
    side.states["q"] = RequestEviction(spec=spec, prompt_len=8, max_blocks=4, rounds=3, compacted=True)
    side.on_preempt(SimpleNamespace(request_id="q"))           # no round pending: nothing to give back
    assert side.states["q"].rounds == 3
