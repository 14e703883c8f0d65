"""Every change kvtier makes to vLLM, in one place. Pinned to vLLM 0.31.0 (checked at start-up).

Each patch wraps one function and calls the original; all are inert unless the engine was started with
`additional_config={"kvtier": {...}}` (so a plain vLLM engine in the same environment is untouched).
Installing is idempotent: applying twice would apply offsets twice.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("kvtier.engine")

PINNED_VLLM = "0.31.0"
_INSTALLED = False


@dataclass(frozen=True)
class Patch:
    target: str     # "module:Class.method"
    why: str        # what it changes and what it assumes about vLLM 0.31
    make: Callable  # original -> replacement


def _resolve(target: str):
    mod_name, attr = target.split(":")
    module = __import__(mod_name, fromlist=["_"])
    owner_name, meth = attr.rsplit(".", 1) if "." in attr else (None, attr)
    owner = getattr(module, owner_name) if owner_name else module
    return owner, meth


# -- frontend ---------------------------------------------------------------------------------------
def _create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        from .support import check_supported

        check_supported(config)
        return config
    return create_engine_config


def _process_inputs(orig):
    @functools.wraps(orig)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = orig(self, request_id, prompt, params, *args, **kwargs)
        from .support import validate_engine_request

        validate_engine_request(self.vllm_config, request)
        return request
    return process_inputs


# -- scheduler process -----------------------------------------------------------------------------
def _scheduler_init(orig):
    @functools.wraps(orig)
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        orig(self, vllm_config, kv_cache_config, *args, **kwargs)
        from .config import EngineEvictionConfig
        from .scheduler_side import SchedulerEviction
        from .support import check_supported

        cfg = EngineEvictionConfig.from_vllm(vllm_config)
        self._kvtier = None
        if cfg is not None:
            check_supported(vllm_config, kv_cache_config)
            group = kv_cache_config.kv_cache_groups[0]
            self._kvtier = SchedulerEviction(cfg, group.kv_cache_spec.block_size, kv_cache_config.num_blocks - 1)
            self.kv_cache_manager._kvtier = self._kvtier
    return __init__


def _schedule(orig):
    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is None:
            return orig(self, *args, **kwargs)
        from .payload import PAYLOAD_ATTR

        ev.plan(self)
        out = orig(self, *args, **kwargs)
        setattr(out, PAYLOAD_ATTR, ev.payload(out))
        return out
    return schedule


def _add_request(orig):
    @functools.wraps(orig)
    def add_request(self, request):
        orig(self, request)
        ev = getattr(self, "_kvtier", None)
        if ev is not None and request.request_id in self.requests:
            ev.on_add(self.requests[request.request_id])
    return add_request


def _preempt_request(orig):
    @functools.wraps(orig)
    def _preempt(self, request, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            ev.on_preempt(request)
        return orig(self, request, *args, **kwargs)
    return _preempt


def _free_request(orig):
    @functools.wraps(orig)
    def _free(self, request, *args, **kwargs):
        out = orig(self, request, *args, **kwargs)
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            ev.on_free(request.request_id)
        return out
    return _free


def _allocate_slots(orig):
    @functools.wraps(orig)
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        st = ev.states.get(request.request_id) if ev is not None else None
        if st is None:
            return orig(self, request, num_new_tokens, *args, **kwargs)
        from .scheduler_side import is_waiting

        waiting = is_waiting(request)
        if waiting and not ev.admit(request):
            return None
        offset = st.offset
        # vLLM sizes the request from num_computed_tokens (logical); the cache holds the physical length.
        request.num_computed_tokens -= offset
        try:
            blocks = orig(self, request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += offset
        if blocks is not None and waiting:
            ev.admitted(request)
        return blocks
    return allocate_slots


# -- worker process --------------------------------------------------------------------------------
def _initialize_kv_cache(orig):
    @functools.wraps(orig)
    def initialize_kv_cache(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        from .config import EngineEvictionConfig
        from .worker_side import WorkerEviction

        cfg = EngineEvictionConfig.from_vllm(self.vllm_config)
        self.kvtier = WorkerEviction(self, cfg) if cfg is not None else None
        if self.kvtier is not None:
            self.kvtier.install_query_capture()
    return initialize_kv_cache


def _update_states(orig):
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


def _prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = orig(self, scheduler_output, *args, **kwargs)
        ev = getattr(self, "kvtier", None)
        if ev is not None:
            ev.after_prepare_inputs(scheduler_output, self.input_batch.num_reqs)
        return out
    return _prepare_inputs


PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config",
          "refuse, in the caller's process, configurations eviction cannot serve (prefix caching, spec "
          "decoding, sliding-window/MLA/hybrid models, pipeline parallelism)", _create_engine_config),
    Patch("vllm.v1.engine.input_processor:InputProcessor.process_inputs",
          "validate kvtier_* request parameters in the frontend, so bad input is a 400 and never reaches "
          "the engine core; assumes it returns the EngineCoreRequest with prompt_token_ids", _process_inputs),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__",
          "attach the scheduler-side eviction state; assumes one KV cache group", _scheduler_init),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule",
          "before scheduling, compact due decode requests and free their tail blocks; after, attach the "
          "step payload (ops, offsets) to SchedulerOutput, which reaches the worker", _schedule),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.add_request",
          "resolve the request's eviction spec from SamplingParams.extra_args", _add_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
          "a preempted request is recomputed from scratch (num_computed_tokens=0): reset its offset and "
          "drop any pending copy", _preempt_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._free_request",
          "drop eviction state of finished/aborted requests", _free_request),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
          "size compressed requests from the physical length (logical - offset) and apply reserve-mode "
          "admission; assumes allocate_slots reads request.num_computed_tokens", _allocate_slots),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache",
          "probe the backend's paged layout and set up the worker-side eviction state (CPU runner inherits "
          "it; CPUModelRunner.initialize_kv_cache calls super())", _initialize_kv_cache),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
          "run every due compaction before vLLM zeroes or appends blocks (freed tail blocks may already "
          "belong to another request this step), then cut block lists and block-table rows", _update_states),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          "after inputs are prepared, rewrite slot mapping and seq_lens to physical positions; positions "
          "(RoPE) stay logical", _prepare_inputs),
)


def install() -> None:
    """Apply every patch once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for patch in PATCHES:
        owner, name = _resolve(patch.target)
        original = getattr(owner, name)
        if getattr(original, "__kvtier_patched__", False):
            continue
        replacement = patch.make(original)
        replacement.__kvtier_patched__ = True
        replacement.__kvtier_original__ = original
        setattr(owner, name, replacement)
    _INSTALLED = True
    logger.debug("kvtier: %d vLLM patches installed", len(PATCHES))
