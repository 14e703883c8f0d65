"""kvtier's patches on vLLM's worker: the V1 `GPUModelRunner` (which the CPU runner inherits), the workers'
`wake_up`, each attention layer's `impl.forward`, and `VllmConfig.use_v2_model_runner` (which runner the
workers build). Listed with why in patches.py `PATCHES` and `ATTENTION_CAPTURE`.

Each function takes vLLM's original and returns its replacement, which calls the original; the worker-side
eviction state (worker_side.WorkerEviction) is kept on the model runner as `kvtier` (None without
additional_config.kvtier). Assumes, of vLLM 0.31: `GPUModelRunner.initialize_kv_cache(kv_cache_config,
is_profiling=...)` (CPUModelRunner calls super()), `_update_states(scheduler_output)`,
`_prepare_inputs(scheduler_output, ...)` and `sample_tokens(...)` are the V1 runner's step; the worker's
`wake_up(tags)` is what collective_rpc('wake_up') runs, and its runner is `model_runner`;
unified_attention_with_output calls layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata,
...) eagerly; `use_v2_model_runner` is a property on VllmConfig.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("kvtier.engine")


# -- GPUModelRunner ------------------------------------------------------------------------------------
def initialize_kv_cache(orig):
    @functools.wraps(orig)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        orig(self, kv_cache_config, *args, **kwargs)
        from . import compat
        from .allowlist import worker_violations
        from .config import EngineEvictionConfig
        from .support import UnsupportedEngineConfig
        from .worker_side import WorkerEviction

        cfg = EngineEvictionConfig.from_vllm(self.vllm_config)
        # The CUDA-graph memory profile initialises a throw-away cache first (is_profiling=True): no
        # WorkerEviction for it, whose row views would keep that buffer alive next to the real cache.
        if cfg is None or kwargs.get("is_profiling", args[0] if args else False):
            self.kvtier = None
            return
        problems = worker_violations(compat.attention_backend_name(self), compat.kernel_block_sizes(self),
                                     compat.kv_cache_group(self).kv_cache_spec.block_size)
        if problems:
            raise UnsupportedEngineConfig("kvtier eviction (additional_config.kvtier) cannot run with: "
                                          + "; ".join(problems) + " (tested configurations: `kvtier engine supported`)")
        self.kvtier = WorkerEviction(self, cfg)
        install_attention_capture(self.kvtier)
    return initialize_kv_cache


def update_states(orig):
    @functools.wraps(orig)
    def _update_states(self, scheduler_output):
        ev = getattr(self, "kvtier", None)
        if ev is not None:
            ev.before_update_states(scheduler_output)
        out = orig(self, scheduler_output)
        if ev is not None:
            ev.after_update_states(scheduler_output)
        return out
    return _update_states


def prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = orig(self, scheduler_output, *args, **kwargs)
        ev = getattr(self, "kvtier", None)
        if ev is not None:
            ev.after_prepare_inputs(scheduler_output, self.input_batch.num_reqs)
        return out
    return _prepare_inputs


def sample_tokens(orig):
    @functools.wraps(orig)
    def sample_tokens(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        ev = getattr(self, "kvtier", None)
        failed = ev.take_failures() if ev is not None else None
        if failed:
            from .payload import FAILURES_ATTR

            # async scheduling returns a wrapper whose get_output() hands back this same object
            target = getattr(out, "_model_runner_output", out)
            setattr(target, FAILURES_ATTR, failed)
        return out
    return sample_tokens


# -- Worker / CPUWorker -------------------------------------------------------------------------------
def wake_up(orig):
    @functools.wraps(orig)
    def wake_up(self, tags=None, *args, **kwargs):
        out = orig(self, tags, *args, **kwargs)
        ev = getattr(getattr(self, "model_runner", None), "kvtier", None)
        if ev is not None:
            ev.on_wake(tags)
        return out
    return wake_up


# -- VllmConfig.use_v2_model_runner (read in every process) -----------------------------------------------
class _PatchedProperty(property):
    """A property that takes attributes: install() marks each replacement with __kvtier_patched__ /
    __kvtier_original__, which a plain `property` object refuses."""


_V1_FORCED_LOGGED = False  # the override is logged once per process (the property is read many times)


def use_v2_model_runner(orig):
    """`VllmConfig.use_v2_model_runner` is a property: wrap its fget and return a new property (install()
    then does setattr(VllmConfig, "use_v2_model_runner", <property>), which replaces it on the class)."""
    fget = orig.fget

    @functools.wraps(fget)
    def use_v2_model_runner(self):
        from .config import EngineEvictionConfig

        if EngineEvictionConfig.from_vllm(self) is None:
            return fget(self)
        from .support import v2_model_runner_conflict

        if v2_model_runner_conflict(self) is not None:
            # V2 is forced (VLLM_USE_V2_MODEL_RUNNER=1, HiSparse, watermark): not overridden but refused, by
            # check_supported (UnsupportedEngineConfig) in create_engine_config and Scheduler.__init__. Not
            # raised here: VllmConfig.__post_init__ reads this property and pydantic would turn the error
            # into a ValidationError.
            return fget(self)
        import vllm.envs as envs

        if envs.VLLM_USE_V2_MODEL_RUNNER is False:
            return False  # the user chose V1: nothing to override
        if fget(self):  # vLLM would pick V2 (its default on GPU with Triton): override, once per process
            global _V1_FORCED_LOGGED
            if not _V1_FORCED_LOGGED:
                _V1_FORCED_LOGGED = True
                logger.warning(
                    "kvtier: using vLLM's V1 model runner instead of Model Runner V2 (vLLM's default here): "
                    "kvtier eviction patches only the V1 GPUModelRunner (additional_config.kvtier is set)")
        return False

    return _PatchedProperty(use_v2_model_runner, orig.fset, orig.fdel, orig.__doc__)


# -- attention layers (patches.ATTENTION_CAPTURE, per instance) -----------------------------------------
def wrap_attention_forward(forward, hook_owner):
    """Per-layer patch (ATTENTION_CAPTURE): call `hook_owner._kvtier_capture(layer, query, key)` before
    the attention kernel. The hook is looked up on every call, so a cache re-initialisation (vLLM
    initialises twice on GPU: profiling, then real) replaces it instead of leaving a stale closure."""
    if getattr(forward, "__kvtier_patched__", False):
        return forward

    @functools.wraps(forward)
    def patched(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        hook = getattr(hook_owner, "_kvtier_capture", None)
        if hook is not None and attn_metadata is not None:
            hook(layer, query, key)
        return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    patched.__kvtier_patched__ = True
    return patched


def install_attention_capture(ev) -> None:
    """Wrap every attention layer of `ev` (a worker_side.WorkerEviction) with ATTENTION_CAPTURE
    (wrap_attention_forward), its hook feeding ev.capture; the hook is looked up on the layer at each call,
    so a second cache initialisation replaces it."""
    for li, layer in enumerate(ev.layers):
        layer.impl.forward = wrap_attention_forward(layer.impl.forward, layer)
        layer._kvtier_capture = (lambda _layer, q, k, _li=li: ev.capture.capture(_li, q, k)
                                 if ev.capture.rows else None)
