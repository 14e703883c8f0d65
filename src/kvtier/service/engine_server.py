"""The engine deployment: Ray Serve LLM's `LLMServer` hosting a compressed vLLM `AsyncLLM`.

Additions to the stock server:
- `kvtier_generate(kind, body)`: completions/chat from a plain JSON body, answering plain JSON/SSE (the
  router never imports vLLM); vLLM's and kvtier's input errors become 400 bodies. Its first item carries
  the replica's timestamps for the router's time-to-first-token breakdown (`first_item`).
- `kvtier_load()`: the scheduler's load after its latest step (running / waiting requests, KV pool usage and
  free blocks), captured by a stat logger attached to the engine, plus the requests the frontend has in
  flight; the router polls every replica's load for the KV-pressure rule.
- `kvtier_eviction_stats()`: the kvtier eviction counters from the worker (via `kvtier.engine.worker_ext`).
- `check_health()`: Serve's replica health check also fails on the `errored` flag of the load, so Serve
  replaces a replica whose engine failed.
- vLLM's own metrics go to Ray tagged with the replica's deployment (`engine_metrics.install`).
- `start()`: waits (bounded) for the model's files before vLLM starts, then keeps the pod-readiness
  heartbeat and kvtier's KV gauges fresh on a period of its own (engine_upkeep.py).
The engine is warmed up with a 16-token prompt before it serves (see kvtier.engine.api.WARMUP_PROMPT_TOKENS).
"""

from __future__ import annotations

import json
import asyncio
import logging
import os
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError
from vllm.exceptions import VLLMClientError
from vllm.v1.metrics.loggers import StatLoggerBase

from ray.serve.llm import LLMServer

from kvtier.engine import compat
from kvtier.engine.api import WARMUP_PROMPT_TOKENS

from .coalesce import coalesce
from .first_token import first_item
from .ray_compat import CallbackBase, VLLMEngine, sanitize_chat_request
from .usage import prompts_in, with_final_budget

logger = logging.getLogger("kvtier.service")


class LocalModelCallback(CallbackBase):
    """Skip Ray Serve LLM's per-node model download task when the model is a local directory (it would
    start a Ray worker per node just to find the files already there)."""

    async def on_before_node_init(self) -> None:
        source = self.llm_config.model_loading_config.model_source
        if isinstance(source, str) and os.path.isdir(source):
            self.ctx.run_init_node = False


class LoadTracker(StatLoggerBase):
    """A vLLM stat logger keeping the scheduler's stats of its latest step, per engine index.

    The engine core attaches `SchedulerStats` to the outputs of every step (including the step that
    follows an abort or a finish, so an idle engine reports its idle pool), made after the step's KV
    reclaim (kvtier's compaction frees tail blocks inside `schedule()`), and the frontend's output
    handler hands them to every stat logger as soon as it reads them. While the engine is busy the load
    is therefore at most one step old, and when it is idle it is the idle state. (The intermittent
    "running=0 with every block free during a stream" seen in the e2e tests was not this path: the test's
    HTTP client had itself closed the stream, see tests/test_service_e2e.py.)"""

    def __init__(self) -> None:
        self.by_engine: dict[int, tuple[int, int, float]] = {}   # engine index -> (running, waiting, kv usage)
        self.updated_at = 0.0
        self.steps = 0
        self.preemptions = 0   # vLLM's own count (IterationStats), since the engine started

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        if scheduler_stats is None:
            return
        waiting = scheduler_stats.num_waiting_reqs + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
        self.by_engine[engine_idx or 0] = (scheduler_stats.num_running_reqs, waiting,
                                           float(scheduler_stats.kv_cache_usage))
        self.updated_at = time.time()
        self.steps += 1

    def log_engine_initialized(self) -> None:
        pass


class KVTierVLLMEngine(VLLMEngine):
    async def start(self) -> None:
        await super().start()
        import ray

        from .cpu_priority import NICE_ENV, lower_serving_priority

        if os.environ.get(NICE_ENV):   # a local Ray: this replica steps back now that its vLLM processes exist
            lower_serving_priority(int(os.environ[NICE_ENV]), include_self=True)

        self.node_id = ray.get_runtime_context().get_node_id()
        self.load_tracker = LoadTracker()
        manager = compat.stat_logger_manager(self._engine_client)
        if manager is None:
            raise RuntimeError("kvtier: the engine runs without vLLM's scheduler stats (disable_log_stats?); the "
                               "router's KV-pressure rule reads them: leave disable_log_stats off")
        from .engine_metrics import install

        install(manager, self._engine_client.vllm_config)   # vLLM's metrics, tagged with this deployment
        compat.stat_loggers(manager).append(self.load_tracker)
        await self._warm_up()
        if self.load_tracker.steps == 0:  # the stats of the warm-up's steps must have reached the tracker
            raise RuntimeError("kvtier: vLLM's scheduler stats do not reach kvtier's load tracker "
                               f"(stat loggers: {[type(x).__name__ for x in compat.stat_loggers(manager)]})")

    async def _warm_up(self) -> None:
        from vllm import SamplingParams

        prompt = {"prompt_token_ids": list(range(10, 10 + WARMUP_PROMPT_TOKENS))}
        async for _ in self._engine_client.generate(prompt, SamplingParams(max_tokens=2, temperature=0),
                                                     request_id=f"kvtier-warmup-{time.time_ns()}"):
            pass

    def load(self) -> dict[str, Any]:
        """This replica's load: the scheduler's after its latest step (summed over data-parallel engines)."""
        cache = self._engine_client.vllm_config.cache_config
        per_engine = max((cache.num_gpu_blocks or 1) - 1, 0)  # the null block is never handed out
        t = self.load_tracker
        engines = list(t.by_engine.values()) or [(0, 0, 0.0)]
        total = per_engine * len(engines)
        free = sum(round((1.0 - usage) * per_engine) for _, _, usage in engines)
        now = time.time()
        return {
            "running": sum(r for r, _, _ in engines), "waiting": sum(w for _, w, _ in engines),
            "kv_usage": 1.0 - free / total if total else 0.0, "total_blocks": total, "free_blocks": free,
            "block_size": cache.block_size, "updated_at": t.updated_at, "age_s": round(now - t.updated_at, 3),
            "steps": t.steps, "preemptions": t.preemptions,
            # requests the frontend has sent to the engine core and not seen finish (a cross-check)
            "in_flight": compat.in_flight_requests(self._engine_client),
            "errored": self.errored, "node_id": self.node_id,
        }

    @property
    def errored(self) -> bool:
        """vLLM's engine client has failed (its engine core died or its output handler stopped)."""
        return bool(getattr(getattr(self, "_engine_client", None), "errored", False))


EXPORT_EVERY_S = 5.0


class KVTierLLMServer(LLMServer):
    _default_engine_cls = KVTierVLLMEngine

    async def start(self):
        """Ray Serve LLM's start (the engine), after the model's files are there (bounded: engine_upkeep), then
        the replica's upkeep task: readiness heartbeat and KV gauges every few seconds."""
        from . import engine_upkeep

        await engine_upkeep.wait_for_model_files(self._llm_config)
        await super().start()
        self._upkeep = asyncio.get_running_loop().create_task(engine_upkeep.run(self))

    async def kvtier_generate(self, kind: str, payload: dict[str, Any]) -> AsyncIterator[str | dict[str, Any]]:
        """OpenAI completion ("completions") or chat ("chat") from a plain JSON body, yielding only plain
        data so the router never unpickles vLLM types: SSE text for streams, {"response": body} for a
        whole response, {"error": {...}} for a rejected request. The first item is wrapped by
        `first_item` with this replica's arrival and first-output times."""
        received = time.time()
        first = True
        async for item in self._generate(kind, payload):
            yield first_item(item, received) if first else item
            first = False

    async def _generate(self, kind: str, payload: dict[str, Any]) -> AsyncIterator[str | dict[str, Any]]:
        from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

        try:
            if kind == "chat":
                request = sanitize_chat_request(ChatCompletionRequest.model_validate(payload))
            else:
                request = CompletionRequest.model_validate(payload)
        except (ValidationError, ValueError, TypeError, VLLMClientError) as exc:
            yield {"error": {"message": _validation_message(exc), "type": "invalid_request_error", "code": 400}}
            return
        started = False
        try:
            stream = await (self.chat(request) if kind == "chat" else self.completions(request))
            interval = self._llm_config.experimental_configs.get("kvtier_stream_interval_ms", 0) / 1000
            prompts = prompts_in(payload) if kind != "chat" else 1
            async for item in coalesce(stream, interval) if request.stream and interval > 0 else stream:
                plain = with_final_budget(_plain(item), prompts)
                error = None if started else _sse_error(plain)
                # vLLM's stream reports input errors it finds once generating (a token id beyond the vocabulary)
                # as its first event; before any token that is still the caller's 4xx, not a 200 stream
                yield error if error is not None else plain
                if error is not None:
                    return
                started = True
        except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's input checks, incl. kvtier's
            error = {"message": str(exc) or type(exc).__name__, "type": "invalid_request_error", "code": 400}
            yield f"data: {json.dumps({'error': error})}\n\n" if started else {"error": error}

    async def check_health(self) -> None:
        """Serve's replica health check (raising makes Serve replace the replica): Ray Serve LLM's own (vLLM's),
        then the `errored` flag the router reads from kvtier_load, so both see a failed engine alike."""
        await super().check_health()
        if self.engine is not None and getattr(self.engine, "errored", False):
            raise RuntimeError("kvtier: the vLLM engine of this replica has errored; Serve replaces the replica")

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's per-replica routing stats: what replica_router.MostFreeKVRouter ranks replicas by."""
        if self.engine is None:
            return {}
        load = self.engine.load()
        return {"free_blocks": load["free_blocks"], "total_blocks": load["total_blocks"],
                "waiting": load["waiting"], "errored": load["errored"]}

    async def kvtier_load(self) -> dict[str, Any]:
        load = self.engine.load()
        load["replica"] = self._replica_id()
        exporter = self._metrics_exporter()
        if exporter is not None:
            exporter.update_load(load)   # gauges on every poll: Ray ages out gauges that are not refreshed
            now, steps = time.time(), load["steps"]
            # off the poll's path, and only after engine steps: a collective RPC wakes the worker, whose
            # message queue then busy-polls for a second (an idle engine would burn a sixth of a core)
            due = now - getattr(self, "_exported_at", 0.0) >= EXPORT_EVERY_S
            if due and steps != getattr(self, "_exported_steps", -1):
                self._exported_at, self._exported_steps = now, steps
                asyncio.ensure_future(self._export_counters(exporter))
        return load

    def _replica_id(self) -> str:
        if getattr(self, "_replica", None) is None:
            try:
                from ray import serve

                self._replica = serve.get_replica_context().replica_id.unique_id
            except Exception:  # noqa: BLE001 - outside Serve (tests): one replica
                self._replica = "local"
        return self._replica

    def _metrics_exporter(self):
        """The catalog's engine metrics (created on first use; None if Ray metrics are unavailable)."""
        if getattr(self, "_exporter", None) is None:
            try:
                from ray import serve

                from kvtier.observability.exporters import EngineMetricsExporter

                self._exporter = EngineMetricsExporter(serve.get_replica_context().deployment)
            except Exception as exc:  # noqa: BLE001 - metrics never fail a request
                logger.warning("kvtier metrics unavailable: %s", exc)
                self._exporter = False
        return self._exporter or None

    async def _export_counters(self, exporter) -> None:
        """Every EXPORT_EVERY_S (piggybacking on the router's load polls), push the eviction counters and
        round times from the worker. Best effort: metrics never fail a request."""
        try:
            client = self.engine._engine_client
            snap = (await client.collective_rpc("kvtier_eviction_stats", args=(None,)))[0]
            samples = (await client.collective_rpc("kvtier_drain_round_ms"))[0]
            exporter.update(snap, round_ms=samples)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kvtier metrics export failed: %s", exc)

    async def kvtier_eviction_stats(self, request_ids: list[str] | None = None) -> dict | None:
        results = await self.engine._engine_client.collective_rpc("kvtier_eviction_stats", args=(request_ids,))
        return results[0] if results else None


def _plain(item: Any) -> str | dict[str, Any]:
    if isinstance(item, list):  # Ray Serve LLM batches stream chunks
        return "".join(x if isinstance(x, str) else f"data: {x.model_dump_json()}\n\n" for x in item)
    if isinstance(item, str):
        return item
    if type(item).__name__ == "ErrorResponse":
        return {"error": item.error.model_dump(mode="json")}
    return {"response": item.model_dump(mode="json")}


def _sse_error(chunk: Any) -> dict[str, Any] | None:
    """{"error": {...}} if `chunk` is nothing but one SSE error event (optionally followed by [DONE])."""
    if not isinstance(chunk, str) or not chunk.startswith('data: {"error"'):
        return None
    events = [e for e in chunk.split("\n\n") if e.strip() and e.strip() != "data: [DONE]"]
    try:
        body = json.loads(events[0].removeprefix("data: ")) if len(events) == 1 else None
    except json.JSONDecodeError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("error"), dict) else None


def _validation_message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
    return str(exc)
