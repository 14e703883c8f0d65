"""Every change kvtier makes to vLLM, in one place, for each supported release (versions.TESTED: 0.31.0 and
0.32.0, checked at start-up by plugin.check_vllm_version; the same 20 functions in both).

`PATCHES` lists each patch: the vLLM function it wraps, why, and what it assumes about vLLM (0.31 and 0.32
alike; where they differ, compat.py keys the difference by minor). The
replacements themselves live by the vLLM seam they patch: patch_frontend.py (EngineArgs, InputProcessor),
patch_scheduler.py (Scheduler), patch_kv_cache.py (KVCacheManager, KVCacheCoordinator: allocation and the
prefix cache), patch_worker.py (GPUModelRunner, the workers' wake_up, VllmConfig.use_v2_model_runner, the
per-layer attention wrapper `ATTENTION_CAPTURE`), patch_shm.py (the shared-memory queues).

Each patch wraps one function and calls the original; all are inert unless the engine was started with
`additional_config={"kvtier": {...}}` (the shared-memory queue patch: unless KVTIER_SHM_SPIN_S is set), so
a plain vLLM engine in the same environment is untouched.
Installing is idempotent: applying twice would apply offsets twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from . import patch_frontend as frontend
from . import patch_kv_cache as kv_cache
from . import patch_scheduler as scheduler
from . import patch_shm as shm
from . import patch_worker as worker
from .patch_shm import SHM_SPIN_ENV  # noqa: F401  (kvtier.service sets it for its engines' processes)
from .versions import DEFAULT

logger = logging.getLogger("kvtier.engine")

PINNED_VLLM = DEFAULT   # the release the images and the default environment install (versions.DEFAULT)
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


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# Not installed at import: applied per attention layer instance once the worker's `WorkerEviction` exists
# (patch_worker.install_attention_capture), because the implementation class differs by backend (CPU,
# FlashAttention, ...). Listed here with the others.
ATTENTION_CAPTURE = Patch(
    "<attention layer>.impl.forward (per instance)",
    "keep recent post-RoPE queries (and keys, for H2O) of requests whose policy reads them; assumes vLLM "
    "0.31's unified_attention_with_output calls layer.impl.forward(layer, query, key, value, kv_cache, "
    "attn_metadata, ...) eagerly: under full CUDA graphs it is not replayed, so query-reading policies "
    "are refused there (support.py)", worker.wrap_attention_forward)


PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config",
          "refuse, in the caller's process, configurations eviction is not tested in (allowlist.TESTED: spec "
          "decoding, sliding-window/MLA/hybrid models, pipeline parallelism, ...)", frontend.create_engine_config),
    Patch("vllm.v1.engine.input_processor:InputProcessor.process_inputs",
          "validate kvtier_* request parameters in the frontend, so bad input is a 400 and never reaches "
          "the engine core; assumes it returns the EngineCoreRequest with prompt_token_ids", frontend.process_inputs),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__",
          "attach the scheduler-side eviction state; assumes one KV cache group", scheduler.scheduler_init),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule",
          "before scheduling, compact due decode requests and free their tail blocks; after, attach the "
          "step payload (ops, offsets) to SchedulerOutput, which reaches the worker", scheduler.schedule),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
          "abort (FINISHED_ERROR) the requests whose eviction policy failed in the worker this step; the "
          "worker compacted them with a fallback, so the engine and every other request keep running; put "
          "each finished request's final budget on its last EngineCoreOutput (final_budget.py); assumes it "
          "returns {client index: EngineCoreOutputs} and frees a finished request before building its output",
          scheduler.update_from_output),
    Patch("vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
          "take kvtier's final-budget reports off finished outputs' kv_transfer_params before vLLM builds "
          "the RequestOutput (vLLM's responses stay as they were) and keep them by external request id for "
          "kvtier's server (final_budget.py); assumes process_outputs(engine_core_outputs, ...) with "
          "`request_states` by internal id, each with `external_req_id`", frontend.process_outputs),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.add_request",
          "resolve the request's eviction spec from SamplingParams.extra_args", scheduler.add_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
          "a preempted request is recomputed from scratch (num_computed_tokens=0): reset its offset and "
          "drop any pending copy", scheduler.preempt_request),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._free_request",
          "drop eviction state of finished/aborted requests", scheduler.free_request),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
          "size compressed requests from the physical length (logical - offset) and apply reserve-mode "
          "admission (a prefix-cache hit's blocks that running requests hold are not counted twice); assumes "
          "allocate_slots reads request.num_computed_tokens and the scheduler passes new_computed_blocks by "
          "keyword", kv_cache.allocate_slots),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
          "prefix caching: a compressed request reads cached blocks only inside its protected prefix "
          "(scheduler_side.prefix_cache_caps); assumes it returns (KVCacheBlocks, num_tokens, boundary) with "
          "block-aligned hits (one full-attention group: hash block size == block size)", kv_cache.get_computed_blocks),
    Patch("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.cache_blocks",
          "prefix caching: a compressed request's blocks are hashed into the cache only while they lie wholly "
          "inside its protected prefix (later blocks are rewritten by compaction); assumes every caller "
          "(allocate_slots, KVCacheManager.cache_blocks) goes through the coordinator's cache_blocks, which "
          "one-group models (UnitaryKVCacheCoordinator) inherit", kv_cache.cache_blocks),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache",
          "probe the backend's paged layout and set up the worker-side eviction state (CPU runner inherits "
          "it; CPUModelRunner.initialize_kv_cache calls super())", worker.initialize_kv_cache),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
          "run every due compaction before vLLM zeroes or appends blocks (freed tail blocks may already "
          "belong to another request this step), then cut block lists and block-table rows", worker.update_states),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
          "report requests whose policy failed on the step's ModelRunnerOutput (the object async "
          "scheduling's wrapper returns from get_output)", worker.sample_tokens),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          "after inputs are prepared, rewrite slot mapping and seq_lens to physical positions; positions "
          "(RoPE) stay logical", worker.prepare_inputs),
    Patch("vllm.v1.worker.gpu_worker:Worker.wake_up",
          "after vLLM wakes the worker (sleep levels 1 and 2 discard the 'kv_cache' memory pool; the CuMem "
          "allocator re-maps it at the same addresses with its contents lost), rebuild kvtier's device "
          "tables (paged-layout offsets, row table, global KV heads) from host copies and the row views "
          "from the caches as bound now, and reset per-request worker state (vLLM preempted or aborted "
          "every request at sleep). vLLM 0.31 allocates only the KV tensors inside the pool "
          "(initialize_kv_cache_tensors), but nothing kvtier needs relies on that. Assumes Worker.wake_up("
          "tags) is what executor.wake_up's collective_rpc('wake_up') runs (XPUWorker inherits it)",
          worker.wake_up),
    Patch("vllm.v1.worker.cpu_worker:CPUWorker.wake_up",
          "the same hook on the CPU worker, whose wake_up overrides Worker.wake_up without calling it "
          "(vLLM has no sleep mode on CPU; LLM.sleep/wake_up still run the whole dispatch down to the "
          "worker, which is how tests exercise the rebuild). Installed only on the CPU platform",
          worker.wake_up, when=_on_cpu),
    Patch("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.__init__",
          "readers' busy-wait after each message from KVTIER_SHM_SPIN_S when set (the service sets it per "
          "engine where EngineConfig.shm_spin_s is set); assumes SpinCondition(is_reader, context, "
          "notify_address, busy_loop_s=1) and that the writer notifies after every enqueue, which vLLM's "
          "own idle path (after busy_loop_s) already relies on", shm.spin_condition_init),
    Patch("vllm.config.vllm:VllmConfig.use_v2_model_runner",
          "force vLLM's V1 model runner when kvtier eviction is configured (V2 is vLLM's default on GPU with "
          "Triton; every worker patch targets the V1 GPUModelRunner), logging the override once; where V2 is "
          "forced (VLLM_USE_V2_MODEL_RUNNER=1, HiSparse, watermark) it answers as vLLM does and "
          "check_supported refuses the engine (UnsupportedEngineConfig). "
          "A property: the replacement is a property; the plugin loads in every vLLM process, so the "
          "scheduler, workers and frontend all see the same answer", worker.use_v2_model_runner),
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
