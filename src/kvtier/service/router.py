"""The router: a FastAPI ingress deployment with the OpenAI-compatible API.

Per request: API key -> tenant -> allowed tiers (auth.py); prompt length (tokens.py); tier (routing.py,
with the engines' load polled in the background); then the request goes to the tier's engine deployment
with the tier's eviction settings as `vllm_xargs`. Responses carry `x-kvtier-tier`, `x-kvtier-reason`
(a stable code, see routing.REASONS) and `x-kvtier-detail`. Engines that are gone or restarting answer
503 (in a stream: an SSE error event), never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from .api_models import ChatBody, CompletionBody, ErrorBody, ModelCard, ModelList
from .auth import Authenticator, AuthError
from .config import ServiceConfig
from .metrics import RouterMetrics
from .routing import Decision, EngineLoad, RequestShape, RouteError, aggregate_loads, engine_load, resolve_model, route

logger = logging.getLogger("kvtier.service")

ERROR_RESPONSES = {s: {"model": ErrorBody} for s in (400, 401, 403, 404, 503, 504)}


class ServeError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, reason: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.param, self.headers = status, message, reason, param, headers or {}


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 503: "service_unavailable", 504: "timeout"}.get(status, "server_error")


def error_response(status: int, message: str, reason: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _error_type(status), "param": param, "code": reason}}
    return JSONResponse(body, status_code=status, headers={"x-kvtier-reason": reason, **(headers or {})})


app = FastAPI(title="kvtier", version="0.1.0",
              description="OpenAI-compatible endpoint of kvtier: requests are routed to KV-memory tiers.")


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return error_response(400, "; ".join(parts) or "invalid request", "invalid-request")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), "http-error")


MAX_LOAD_PROBES = 16   # load calls per engine deployment and poll
REPLICA_FIELDS = ("running", "waiting", "kv_usage", "free_blocks", "total_blocks", "in_flight", "age_s", "steps",
                  "node_id", "polled_at")


# Helpers are defined before the deployment class: Serve pickles the class by value when it is
# decorated, with only the module globals that exist at that point.
def _is_dead(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


def _looks_dead(message: str) -> bool:
    return any(s in message for s in ("EngineDead", "EngineCore encountered an issue", "engine is dead"))


def _take_usage(item: str, keep_usage_chunk: bool) -> tuple[str, dict | None]:
    """The usage block carried by a chunk of SSE events (the last one wins: usage is cumulative), and the
    text with the usage-only chunk (`"choices": []`) removed when the client did not ask for usage. Only
    events carrying a usage object are parsed (pydantic's compact JSON or json.dumps spacing)."""
    if '"usage":{' not in item and '"usage": {' not in item:   # the common case: a token chunk, no usage
        return item, None
    usage, kept = None, []
    for event in item.split("\n\n"):
        if event.startswith("data: {") and ('"usage":{' in event or '"usage": {' in event):
            try:
                data = json.loads(event[len("data: "):])
            except ValueError:
                data = {}
            if isinstance(data.get("usage"), dict):
                usage = data["usage"]
                if not keep_usage_chunk and data.get("choices") == []:
                    continue
        kept.append(event)
    return "\n\n".join(kept), usage


def _engine_failure(exc: BaseException, engine: str) -> ServeError:
    from ray.exceptions import RayError, RayTaskError

    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return ServeError(504, f"engine {engine!r} did not answer in time", "engine-timeout")
    if _is_dead(exc) or _looks_dead(str(exc)):
        return ServeError(503, f"engine {engine!r} went away while serving the request; retry", "engine-unavailable",
                          headers={"retry-after": "5"})
    if isinstance(exc, RayTaskError):  # the engine deployment raised: a bug there, not an outage
        logger.error("engine %s raised: %s", engine, exc)
        return ServeError(500, f"engine {engine!r} failed: {type(getattr(exc, 'cause', exc)).__name__}", "engine-error")
    if isinstance(exc, RayError):
        return ServeError(503, f"engine {engine!r} unavailable: {type(exc).__name__}", "engine-unavailable",
                          headers={"retry-after": "5"})
    logger.exception("engine %s failed", engine)
    return ServeError(500, f"engine {engine!r} failed: {type(exc).__name__}", "engine-error")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class KVTierRouter:
    async def __init__(self, config: dict[str, Any], engines: dict[str, Any], model_paths: dict[str, str]):
        from .tokens import PromptCounter

        self.cfg = ServiceConfig.model_validate(config)
        self.auth = Authenticator(self.cfg)
        self.metrics = RouterMetrics()
        self.engines = engines
        self.streams = {name: h.options(stream=True) for name, h in engines.items()}
        by_path = {path: PromptCounter(path) for path in set(model_paths.values())}
        self.counters = {name: by_path[path] for name, path in model_paths.items()}
        self.loads: dict[str, EngineLoad] = {}
        self.replica_loads: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in engines}
        self.engine_state: dict[str, dict[str, Any]] = {name: {"healthy": True, "last_ok": time.time()}
                                                        for name in engines}
        self.down = {name: asyncio.Event() for name in engines}   # set while an engine is not answering
        self._poller = asyncio.get_running_loop().create_task(self._poll_loads())

    # -- engine load --------------------------------------------------------------------------------
    # Each poll asks every replica of the engine deployment for its load (`kvtier_load`, answered with the
    # replica's id) and the router uses the aggregate (routing.aggregate_loads). Serve picks the replica of
    # each call, so a poll sends one call per replica it expects; replicas that stop answering are dropped.
    def _expected_replicas(self, name: str) -> int | None:
        """The engine deployment's fixed replica count, or None when it autoscales."""
        dep = self.cfg.engines[name].deployment
        n = dep.get("num_replicas", 1)
        return None if dep.get("autoscaling_config") or not isinstance(n, int) else max(n, 1)

    async def _poll_once(self, name: str) -> None:
        poll = self.cfg.server.load_poll_s
        state = self.engine_state[name]
        replicas = self.replica_loads[name]
        expected = self._expected_replicas(name)
        probes = min(MAX_LOAD_PROBES, max(expected or len(replicas) + 1, len(replicas), 1))
        timeout = max(2.0, 2 * poll)
        results = await asyncio.gather(*(asyncio.wait_for(self.engines[name].kvtier_load.remote(), timeout=timeout)
                                         for _ in range(probes)), return_exceptions=True)
        now = time.time()
        answers = [r for r in results if isinstance(r, dict)]
        if not answers:  # any failure of every call means "not answering"
            exc = next(r for r in results if isinstance(r, BaseException))
            state["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if _is_dead(exc):
                replicas.clear()
            if not state.get("answered") and not _is_dead(exc):
                return  # still starting: Serve queues requests until the replica is up
            state["healthy"] = now - state["last_ok"] < max(4.0, 4 * poll) and not _is_dead(exc)
            if not state["healthy"]:
                replicas.clear()
                self.loads.pop(name, None)
                self.down[name].set()
            return
        for raw in answers:
            replicas[str(raw.get("replica", "?"))] = {**raw, "polled_at": now}
        for rid in [r for r, x in replicas.items() if now - x["polled_at"] > max(5.0, 5 * poll)]:
            del replicas[rid]   # gone, replaced or scaled down
        if expected is not None and len(replicas) > expected:   # a replaced replica: keep the newest answers
            for rid in sorted(replicas, key=lambda r: replicas[r]["polled_at"])[:len(replicas) - expected]:
                del replicas[rid]
        agg = aggregate_loads(replicas)
        nodes = {x.get("node_id") for x in replicas.values()}
        state.update(agg, healthy=not agg["errored"], last_ok=now, error=None, answered=True,
                     node_id=next(iter(nodes)) if len(nodes) == 1 else None,
                     replica_loads={r: {k: x.get(k) for k in REPLICA_FIELDS} for r, x in replicas.items()})
        self.down[name].clear()
        self.loads[name] = engine_load(agg)

    async def _poll_loads(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_once(n) for n in self.engines), return_exceptions=True)
            await asyncio.sleep(self.cfg.server.load_poll_s)

    # -- request handling ---------------------------------------------------------------------------
    def _decide(self, request: Request, body: CompletionBody | ChatBody, kind: str) -> Decision:
        try:
            tenant = self.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            raise ServeError(401, exc.message, "unauthorized", headers={"www-authenticate": "Bearer"}) from None
        header_tier = request.headers.get(self.cfg.routing.tier_header)
        if header_tier is not None and body.tier is not None and header_tier != body.tier:
            raise ServeError(400, f"tier given twice: body {body.tier!r}, header {header_tier!r}", "invalid-request", "tier")
        tier = body.tier if body.tier is not None else header_tier
        try:
            model = resolve_model(self.cfg, body.model)
            engine = next(t.engine for t in self.cfg.tiers if self.cfg.model_id(t.engine) == model)
            counter = self.counters[engine]
            if kind == "chat":
                prompt_tokens = counter.chat([{"role": m.role, "content": m.text()} for m in body.messages])
                max_tokens = body.effective_max_tokens
            else:
                prompt_tokens = counter.completion(body.prompt)
                max_tokens = body.max_tokens
            return route(self.cfg, RequestShape(prompt_tokens, max_tokens, model, tier), tenant.tiers, self.loads)
        except RouteError as exc:
            raise ServeError(exc.status, exc.message, exc.reason, exc.param) from None
        except (ValueError, TypeError, IndexError, KeyError) as exc:  # tokenizer / template rejects the input
            raise ServeError(400, f"cannot tokenize the prompt: {exc}", "invalid-request", "prompt") from None

    def _engine_payload(self, body: CompletionBody | ChatBody, decision: Decision, kind: str,
                        request_id: str) -> dict[str, Any]:
        payload = body.model_dump(mode="json", exclude_unset=True, exclude={"tier"})
        payload["model"] = decision.model
        payload["vllm_xargs"] = {**(body.vllm_xargs or {}), **decision.tier.extra_args()}
        payload["request_id"] = request_id
        if body.stream:  # the router counts tokens from the engine's usage chunk (dropped unless asked for)
            payload["stream_options"] = {**(body.stream_options or {}), "include_usage": True}
        return payload

    async def _serve(self, request: Request, body: CompletionBody | ChatBody, kind: str) -> Response:
        t0 = time.perf_counter()
        request_id = f"kvtier-{uuid.uuid4().hex}"
        try:
            decision = self._decide(request, body, kind)
            state = self.engine_state.get(decision.engine, {})
            if not state.get("healthy", True):
                raise ServeError(503, f"engine {decision.engine!r} is unavailable (restarting?); retry shortly",
                                 "engine-unavailable", headers={"retry-after": "5"})
            payload = self._engine_payload(body, decision, kind, request_id)
        except ServeError as exc:
            self.metrics.rejection(exc.status, exc.reason)
            return error_response(exc.status, exc.message, exc.reason, exc.param, exc.headers)
        headers = {self.cfg.routing.tier_header: decision.tier.name, self.cfg.routing.reason_header: decision.reason,
                   "x-kvtier-detail": decision.detail, "x-kvtier-request-id": request_id}
        gen = self.streams[decision.engine].kvtier_generate.remote(kind, payload)
        try:
            first = await self._first_item(gen, decision.engine)
        except Exception as exc:  # noqa: BLE001
            gen.cancel()
            return self._reject(_engine_failure(exc, decision.engine), headers)
        if isinstance(first, dict) and "error" in first:
            gen.cancel()
            err = first["error"]
            code, message = err.get("code"), str(err.get("message", "engine error"))
            status = int(code) if isinstance(code, int) and 400 <= code < 600 else 500
            if status >= 500 and _looks_dead(message):
                return self._reject(ServeError(503, f"engine {decision.engine!r} failed: {message}",
                                               "engine-unavailable", headers={"retry-after": "5"}), headers)
            return self._reject(ServeError(status, message, "engine-rejected", err.get("param")), headers)
        tier = decision.tier.name
        self.metrics.decision(tier, decision.reason)
        if isinstance(first, dict):  # a whole (non-streaming) response
            elapsed = time.perf_counter() - t0
            self.metrics.first_token(tier, elapsed)
            self.metrics.finished(tier, elapsed, first["response"].get("usage"))
            return JSONResponse(first["response"], headers=headers)
        wants_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(self._stream(first, gen, decision.engine, tier, t0, wants_usage),
                                 media_type="text/event-stream", headers=headers)

    async def _first_item(self, gen, engine: str):
        """The engine's first answer; gives up (503) as soon as the poller finds the engine gone, so a
        request queued for a dead replica does not wait for its replacement."""
        first = asyncio.ensure_future(gen.__anext__())
        down = asyncio.ensure_future(self.down[engine].wait())
        try:
            done, _ = await asyncio.wait({first, down}, timeout=self.cfg.server.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if first in done:
            return first.result()
        first.cancel()
        if down in done:
            raise ServeError(503, f"engine {engine!r} stopped answering (restarting?); retry shortly",
                             "engine-unavailable", headers={"retry-after": "5"})
        raise asyncio.TimeoutError()

    def _reject(self, exc: ServeError, headers: dict[str, str]) -> JSONResponse:
        self.metrics.rejection(exc.status, exc.reason)
        keep = {k: v for k, v in headers.items() if k != self.cfg.routing.reason_header}
        return error_response(exc.status, exc.message, exc.reason, exc.param, {**keep, **exc.headers})

    async def _stream(self, first, gen, engine: str, tier: str, t0: float, wants_usage: bool):
        done, usage = False, None
        try:
            item = first
            self.metrics.first_token(tier, time.perf_counter() - t0)
            while True:
                done = done or "data: [DONE]" in item
                item, found = _take_usage(item, keep_usage_chunk=wants_usage)
                usage = found or usage
                if item:
                    yield item
                try:
                    item = await gen.__anext__()
                except StopAsyncIteration:
                    break
            if not done:
                yield "data: [DONE]\n\n"
                done = True
            self.metrics.finished(tier, time.perf_counter() - t0, usage)
        except Exception as exc:  # noqa: BLE001 - the engine died mid-stream: tell the client, then stop
            err = _engine_failure(exc, engine)
            self.metrics.rejection(err.status, err.reason)
            payload = {"error": {"message": err.message, "type": _error_type(err.status), "code": err.status}}
            yield f"data: {json.dumps(payload)}\n\n"
            done = True
        finally:
            if not done:  # client went away: cancel the engine request so its KV blocks are freed
                gen.cancel()
                self.metrics.cancelled(tier)

    # -- endpoints ----------------------------------------------------------------------------------
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(self, body: CompletionBody, request: Request) -> Response:
        return await self._serve(request, body, "completions")

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat(self, body: ChatBody, request: Request) -> Response:
        return await self._serve(request, body, "chat")

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models(self, request: Request):
        try:
            tenant = self.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            return error_response(401, exc.message, "unauthorized")
        cards = []
        for model in self.cfg.model_ids:
            tiers = [{"name": t.name, "budget": t.budget, "policy": t.policy if t.compressed else None,
                      "auto": t.auto, "description": t.description}
                     for t in self.cfg.tiers if self.cfg.model_id(t.engine) == model and t.name in tenant.tiers]
            cards.append(ModelCard(id=model, tiers=tiers))
        return ModelList(data=cards)

    @app.get("/health")
    async def health(self):
        engines = {n: {"healthy": s.get("healthy", True), "error": s.get("error")} for n, s in self.engine_state.items()}
        ok = all(e["healthy"] for e in engines.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "open_mode": self.auth.open_mode, "engines": engines},
                            status_code=200 if ok else 503)

    @app.get("/v1/kvtier/stats")
    async def stats(self, request: Request, eviction: bool = False):
        """Router counters, the engines' last polled load (KV pool free/total blocks, queue) and, with
        `?eviction=true`, each engine's kvtier eviction counters."""
        try:
            self.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            return error_response(401, exc.message, "unauthorized")
        out: dict[str, Any] = {"router": self.metrics.snapshot(), "engines": {}}
        for name in self.engines:
            await self._poll_once(name)  # fresh numbers for callers that wait on them (tests, operators)
            out["engines"][name] = {k: v for k, v in self.engine_state[name].items()}
            if eviction:
                try:
                    ev = await asyncio.wait_for(self.engines[name].kvtier_eviction_stats.remote(), timeout=10)
                    out["engines"][name]["eviction"] = ev["engine"] if ev else None
                except Exception as exc:  # noqa: BLE001
                    out["engines"][name]["eviction"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return out
