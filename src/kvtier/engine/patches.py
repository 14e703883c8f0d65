"""Every change kvtier makes to vLLM, in one place. Pinned to vLLM 0.31.0 (checked at start-up).

Each patch wraps one function and calls the original; all are inert unless the engine was started with
`additional_config={"kvtier": {...}}` (the shared-memory queue patch: unless KVTIER_SHM_SPIN_S is set), so
a plain vLLM engine in the same environment is untouched.
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
    when: Callable[[], bool] | None = None   # installed only where this holds (None: always)


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
        from .support import V2_ADVICE, UnsupportedEngineConfig, check_supported, v2_refusal

        try:
            config = orig(self, *args, **kwargs)
        except ValueError as exc:          # vLLM's "needs Model Runner V2" advice, which kvtier would refuse
            if V2_ADVICE not in str(exc) or "kvtier" not in (getattr(self, "additional_config", None) or {}):
                raise
            raise UnsupportedEngineConfig(v2_refusal(str(exc))) from exc
        check_supported(config)
        return config
    return create_engine_config


def _process_inputs(orig):
    @functools.wraps(orig)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        from vllm.exceptions import VLLMValidationError

        from .config import EngineEvictionConfig
        from .support import V2_ADVICE, KVTierRequestError, v2_refusal, validate_engine_request

        try:
            request = orig(self, request_id, prompt, params, *args, **kwargs)
        except VLLMValidationError as exc:   # e.g. prompt_logprob_token_ids: vLLM advises Model Runner V2
            if V2_ADVICE not in str(exc) or EngineEvictionConfig.from_vllm(self.vllm_config) is None:
                raise
            raise KVTierRequestError(v2_refusal(str(exc)), parameter=getattr(exc, "parameter", None)) from exc

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
            from . import compat

            compat.attach_to_kv_cache_manager(self, self._kvtier)
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
        setattr(out, PAYLOAD_ATTR, ev.payload(self, out))
        return out
    return schedule


def _update_from_output(orig):
    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            from .payload import FAILURES_ATTR

            ev.on_worker_failures(self, getattr(model_runner_output, FAILURES_ATTR, None))
        return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
    return update_from_output


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
        from . import compat
        from .scheduler_side import is_waiting

        waiting = is_waiting(request)
        shared = compat.held_hit_blocks(kwargs.get("new_computed_blocks")) if waiting else 0
        if waiting and not ev.admit(request, shared):
            return None
        offset = st.offset
        # vLLM sizes the request from num_computed_tokens (logical); the cache holds the physical length.
        request.num_computed_tokens -= offset
        try:
            blocks = orig(self, request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += offset
        if blocks is not None and waiting:
            ev.admitted(request, shared)
        return blocks
    return allocate_slots


def _get_computed_blocks(orig):
    @functools.wraps(orig)
    def get_computed_blocks(self, request, *args, **kwargs):
        blocks, num_tokens, *rest = orig(self, request, *args, **kwargs)
        ev = getattr(self, "_kvtier", None)
        if ev is not None and num_tokens:
            allowed = ev.readable_tokens(request.request_id, num_tokens)
            if allowed < num_tokens:
                from . import compat

                blocks, num_tokens = compat.truncate_hit(self, blocks, allowed), allowed
        return (blocks, num_tokens, *rest)
    return get_computed_blocks


def _cache_blocks(orig):
    @functools.wraps(orig)
    def cache_blocks(self, request, num_computed_tokens, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            num_computed_tokens = ev.cacheable_tokens(request.request_id, num_computed_tokens)
        return orig(self, request, num_computed_tokens, *args, **kwargs)
    return cache_blocks


# -- worker process --------------------------------------------------------------------------------
def _initialize_kv_cache(orig):
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


def _wake_up(orig):
    @functools.wraps(orig)
    def wake_up(self, tags=None, *args, **kwargs):
        out = orig(self, tags, *args, **kwargs)
        ev = getattr(getattr(self, "model_runner", None), "kvtier", None)
        if ev is not None:
            ev.on_wake(tags)
        return out
    return wake_up


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# -- every process (shared-memory queues) -----------------------------------------------------------
SHM_SPIN_ENV = "KVTIER_SHM_SPIN_S"   # set by the service for its engines' processes (EngineConfig.shm_spin_s)
_SPIN_LOGGED = False


def _spin_condition_init(orig):
    """vLLM's shared-memory queue readers (the engine core waiting for a worker's output, a worker waiting
    for the next step) spin on sched_yield() for `busy_loop_s` (1 s) after every message before sleeping on
    the queue's notify socket, which the writer pings after every write. With KVTIER_SHM_SPIN_S set, readers
    spin that long instead; 0 waits on the socket at once (one wake-up per message instead of a spinning
    core). Unset: vLLM's own value."""
    @functools.wraps(orig)
    def __init__(self, is_reader, context, notify_address, *args, **kwargs):
        import os

        value = os.environ.get(SHM_SPIN_ENV)
        if is_reader and value is not None and not args and "busy_loop_s" not in kwargs:
            kwargs["busy_loop_s"] = float(value)
            global _SPIN_LOGGED
            if not _SPIN_LOGGED:
                _SPIN_LOGGED = True
                logger.info("kvtier: vLLM's shared-memory queue readers busy-wait %s s after each message "
                            "(vLLM: 1 s), then sleep on the queue's socket (%s)", value, SHM_SPIN_ENV)
        orig(self, is_reader, context, notify_address, *args, **kwargs)
    return __init__


# -- every process (config) ------------------------------------------------------------------------
class _PatchedProperty(property):
    """A property that takes attributes: install() marks each replacement with __kvtier_patched__ /
    __kvtier_original__, which a plain `property` object refuses."""


_V1_FORCED_LOGGED = False  # the override is logged once per process (the property is read many times)


def _use_v2_model_runner(orig):
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


def _sample_tokens(orig):
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


# Not installed at import: applied per attention layer instance once the worker's `WorkerEviction` exists
# (install_attention_capture), because the implementation class differs by backend (CPU,
# FlashAttention, ...). Listed here with the others.
ATTENTION_CAPTURE = Patch(
    "<attention layer>.impl.forward (per instance)",
    "keep recent post-RoPE queries (and keys, for H2O) of requests whose policy reads them; assumes vLLM "
    "0.31's unified_attention_with_output calls layer.impl.forward(layer, query, key, value, kv_cache, "
    "attn_metadata, ...) eagerly: under full CUDA graphs it is not replayed, so query-reading policies "
    "are refused there (support.py)", wrap_attention_forward)


def install_attention_capture(ev) -> None:
    """Wrap every attention layer of `ev` (a worker_side.WorkerEviction) with ATTENTION_CAPTURE, its hook
    feeding ev.capture; the hook is looked up on the layer at each call, so a second cache
    initialisation replaces it."""
    for li, layer in enumerate(ev.layers):
        layer.impl.forward = ATTENTION_CAPTURE.make(layer.impl.forward, layer)
        layer._kvtier_capture = (lambda _layer, q, k, _li=li: ev.capture.capture(_li, q, k)
                                 if ev.capture.rows else None)


PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config",
          "refuse, in the caller's process, configurations eviction is not tested in (allowlist.TESTED: spec "
          "decoding, sliding-window/MLA/hybrid models, pipeline parallelism, ...)", _create_engine_config),
    Patch("vllm.v1.engine.input_processor:InputProcessor.process_inputs",
          "validate kvtier_* request parameters in the frontend, so bad input is a 400 and never reaches "
          "the engine core; assumes it returns the EngineCoreRequest with prompt_token_ids", _process_inputs),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__",
          "attach the scheduler-side eviction state; assumes one KV cache group", _scheduler_init),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule",
          "before scheduling, compact due decode requests and free their tail blocks; after, attach the "
          "step payload (ops, offsets) to SchedulerOutput, which reaches the worker", _schedule),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
          "abort (FINISHED_ERROR) the requests whose eviction policy failed in the worker this step; the "
          "worker compacted them with a fallback, so the engine and every other request keep running",
          _update_from_output),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.add_request",
          "resolve the request's eviction spec from SamplingParams.extra_args", _add_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
          "a preempted request is recomputed from scratch (num_computed_tokens=0): reset its offset and "
          "drop any pending copy", _preempt_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._free_request",
          "drop eviction state of finished/aborted requests", _free_request),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
          "size compressed requests from the physical length (logical - offset) and apply reserve-mode "
          "admission (a prefix-cache hit's blocks that running requests hold are not counted twice); assumes "
          "allocate_slots reads request.num_computed_tokens and the scheduler passes new_computed_blocks by "
          "keyword", _allocate_slots),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
          "prefix caching: a compressed request reads cached blocks only inside its protected prefix "
          "(scheduler_side.prefix_cache_caps); assumes it returns (KVCacheBlocks, num_tokens, boundary) with "
          "block-aligned hits (one full-attention group: hash block size == block size)", _get_computed_blocks),
    Patch("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.cache_blocks",
          "prefix caching: a compressed request's blocks are hashed into the cache only while they lie wholly "
          "inside its protected prefix (later blocks are rewritten by compaction); assumes every caller "
          "(allocate_slots, KVCacheManager.cache_blocks) goes through the coordinator's cache_blocks, which "
          "one-group models (UnitaryKVCacheCoordinator) inherit", _cache_blocks),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache",
          "probe the backend's paged layout and set up the worker-side eviction state (CPU runner inherits "
          "it; CPUModelRunner.initialize_kv_cache calls super())", _initialize_kv_cache),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
          "run every due compaction before vLLM zeroes or appends blocks (freed tail blocks may already "
          "belong to another request this step), then cut block lists and block-table rows", _update_states),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
          "report requests whose policy failed on the step's ModelRunnerOutput (the object async "
          "scheduling's wrapper returns from get_output)", _sample_tokens),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          "after inputs are prepared, rewrite slot mapping and seq_lens to physical positions; positions "
          "(RoPE) stay logical", _prepare_inputs),
    Patch("vllm.v1.worker.gpu_worker:Worker.wake_up",
          "after vLLM wakes the worker (sleep levels 1 and 2 discard the 'kv_cache' memory pool; the CuMem "
          "allocator re-maps it at the same addresses with its contents lost), rebuild kvtier's device "
          "tables (paged-layout offsets, row table, global KV heads) from host copies and the row views "
          "from the caches as bound now, and reset per-request worker state (vLLM preempted or aborted "
          "every request at sleep). vLLM 0.31 allocates only the KV tensors inside the pool "
          "(initialize_kv_cache_tensors), but nothing kvtier needs relies on that. Assumes Worker.wake_up("
          "tags) is what executor.wake_up's collective_rpc('wake_up') runs (XPUWorker inherits it)",
          _wake_up),
    Patch("vllm.v1.worker.cpu_worker:CPUWorker.wake_up",
          "the same hook on the CPU worker, whose wake_up overrides Worker.wake_up without calling it "
          "(vLLM has no sleep mode on CPU; LLM.sleep/wake_up still run the whole dispatch down to the "
          "worker, which is how tests exercise the rebuild). Installed only on the CPU platform",
          _wake_up, when=_on_cpu),
    Patch("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.__init__",
          "readers' busy-wait after each message from KVTIER_SHM_SPIN_S when set (the service sets it per "
          "engine where EngineConfig.shm_spin_s is set); assumes SpinCondition(is_reader, context, "
          "notify_address, busy_loop_s=1) and that the writer notifies after every enqueue, which vLLM's "
          "own idle path (after busy_loop_s) already relies on", _spin_condition_init),
    Patch("vllm.config.vllm:VllmConfig.use_v2_model_runner",
          "force vLLM's V1 model runner when kvtier eviction is configured (V2 is vLLM's default on GPU with "
          "Triton; every worker patch targets the V1 GPUModelRunner), logging the override once; where V2 is "
          "forced (VLLM_USE_V2_MODEL_RUNNER=1, HiSparse, watermark) it answers as vLLM does and "
          "check_supported refuses the engine (UnsupportedEngineConfig). "
          "A property: the replacement is a property; the plugin loads in every vLLM process, so the "
          "scheduler, workers and frontend all see the same answer", _use_v2_model_runner),
)


def install() -> None:
    """Apply every patch once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for patch in PATCHES:
        if patch.when is not None and not patch.when():
            continue
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
