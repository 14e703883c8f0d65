"""The router: a FastAPI ingress deployment with the OpenAI-compatible API; this module is the request path.

Per request: API key -> tenant -> allowed tiers (auth.py); the tenant's rate limit (ratelimit.py, 429); prompt length (tokens.py); tier (routing.py,
with the engines' load polled in the background by engine_health.py); then the request goes to the
tier's engine deployment with the tier's eviction settings as `vllm_xargs`. Responses carry
`x-kvtier-tier`, `x-kvtier-reason` (a stable code, see routing.REASONS) and `x-kvtier-detail`. Engines
that are gone or restarting answer 503 (errors.py; in a stream: an SSE error event, sse.py), never a hang.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from .api_models import ChatBody, CompletionBody, ModelCard, ModelList
from .auth import Authenticator, AuthError
from .config import ServiceConfig
from .engine_health import EngineHealth
from .errors import ERROR_RESPONSES, ServeError, engine_failure, error_response, looks_dead
from .metrics import NO_TIER, RouterMetrics
from .pod_ready import SERVING, Heartbeat, keep_beating, replica_identity
from .ratelimit import RateLimiter, retry_after
from .first_token import segments, unwrap_first
from .routing import Decision, RequestShape, RouteError, resolve_model, route
from .sse import relay_stream
from .weights import wait_for_model


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


# Everything the deployment class uses is imported or defined above it: Serve pickles the class by value
# when it is decorated, with only the module globals that exist at that point.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class KVTierRouter:
    async def __init__(self, config: dict[str, Any], engines: dict[str, Any], model_paths: dict[str, str]):
        from kvtier.observability.exporters import model_wait_reporter

        from .tokens import PromptCounter

        self.cfg = ServiceConfig.model_validate(config)
        self.auth = Authenticator(self.cfg)   # reads the keys here: a tenant without any fails the replica's start
        self.limits = RateLimiter(self.cfg)
        self.metrics = RouterMetrics()
        self.engines = engines
        self.streams = {name: h.options(stream=True) for name, h in engines.items()}
        deployment, replica = replica_identity()
        server = self.cfg.server
        report = model_wait_reporter(deployment) if server.model_wait_s else None
        for path in sorted(set(model_paths.values())):   # the tokenizers' files (bounded: weights.py)
            await wait_for_model(path, server.model_ready_file, server.model_wait_s, f"router replica {replica}",
                                 report=report)
        by_path = {path: PromptCounter(path) for path in set(model_paths.values())}
        self.counters = {name: by_path[path] for name, path in model_paths.items()}
        self.engine_health = EngineHealth(self.cfg, engines)   # the engines' polled load and health (engine_health.py)
        self._poller = self.engine_health.start()
        names = {name: getattr(h, "deployment_name", name) for name, h in engines.items()}
        self._gauges = self.metrics.keep_gauges(self.auth.open_mode, server.load_poll_s, lambda: {
            names[n]: (s.get("healthy", True), int(s.get("errored_replicas") or 0))
            for n, s in self.engine_health.state.items()})
        # this pod's readiness (pod_ready.py): the router serves while its event loop turns
        self._heartbeat = asyncio.get_running_loop().create_task(
            keep_beating(Heartbeat(deployment, replica), lambda: (SERVING, "")))

    # -- request handling ---------------------------------------------------------------------------
    def _decide(self, request: Request, body: CompletionBody | ChatBody, kind: str) -> Decision:
        try:
            tenant = self.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            raise ServeError(401, exc.message, "unauthorized", headers={"www-authenticate": "Bearer"}) from None
        if (wait := self.limits.wait(tenant.name)) is not None:
            raise ServeError(429, f"rate limit of tenant {tenant.name!r} reached; retry in {wait:.1f} s",
                             "rate-limited", headers={"retry-after": retry_after(wait)})
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
            decision = route(self.cfg, RequestShape(prompt_tokens, max_tokens, model, tier), tenant.tiers,
                             self.engine_health.routing_loads())
            self.engine_health.debit(decision, self.cfg)
            return decision
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
        t0, arrived = time.perf_counter(), time.time()
        request_id = f"kvtier-{uuid.uuid4().hex}"
        decision: Decision | None = None
        try:
            decision = self._decide(request, body, kind)
            state = self.engine_health.state.get(decision.engine, {})
            if not state.get("healthy", True):
                raise ServeError(503, f"engine {decision.engine!r} is unavailable (restarting?); retry shortly",
                                 "engine-unavailable", headers={"retry-after": "5"})
            payload = self._engine_payload(body, decision, kind, request_id)
            decided = time.time()
        except ServeError as exc:
            self.metrics.rejection(exc.status, exc.reason, decision.tier.name if decision else NO_TIER)
            return error_response(exc.status, exc.message, exc.reason, exc.param, exc.headers)
        headers = {self.cfg.routing.tier_header: decision.tier.name, self.cfg.routing.reason_header: decision.reason,
                   "x-kvtier-detail": decision.detail, "x-kvtier-request-id": request_id}
        gen = self.streams[decision.engine].kvtier_generate.remote(kind, payload)
        try:
            first, replica_times = unwrap_first(await self._first_item(gen, decision.engine))
        except Exception as exc:  # noqa: BLE001
            gen.cancel()
            return self._reject(engine_failure(exc, decision.engine), headers, decision)
        first_at = time.time()
        breakdown = segments(arrived, decided, replica_times, first_at)
        if isinstance(first, dict) and "error" in first:
            gen.cancel()
            err = first["error"]
            code, message = err.get("code"), str(err.get("message", "engine error"))
            status = int(code) if isinstance(code, int) and 400 <= code < 600 else 500
            if status >= 500 and looks_dead(message):
                return self._reject(ServeError(503, f"engine {decision.engine!r} failed: {message}",
                                               "engine-unavailable", headers={"retry-after": "5"}), headers, decision)
            return self._reject(ServeError(status, message, "engine-rejected", err.get("param")), headers, decision)
        tier = decision.tier.name
        self.metrics.decision(tier, decision.reason)
        self.metrics.first_token_segments(tier, breakdown)
        if isinstance(first, dict):  # a whole (non-streaming) response
            elapsed = time.perf_counter() - t0
            self.metrics.first_token(tier, elapsed)
            self.metrics.finished(tier, elapsed, first["response"].get("usage"))
            return JSONResponse(first["response"], headers=headers)
        wants_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(relay_stream(first, gen, decision.engine, tier, t0, wants_usage, self.metrics,
                                              breakdown, first_at),
                                 media_type="text/event-stream", headers=headers)

    async def _first_item(self, gen, engine: str):
        """The engine's first answer; gives up (503) as soon as the poller finds the engine gone, so a
        request queued for a dead replica does not wait for its replacement."""
        first = asyncio.ensure_future(gen.__anext__())
        down = asyncio.ensure_future(self.engine_health.down[engine].wait())
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

    def _reject(self, exc: ServeError, headers: dict[str, str], decision: Decision) -> JSONResponse:
        self.metrics.rejection(exc.status, exc.reason, decision.tier.name)
        keep = {k: v for k, v in headers.items() if k != self.cfg.routing.reason_header}
        return error_response(exc.status, exc.message, exc.reason, exc.param, {**keep, **exc.headers})

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
            tiers = [{"name": t.name, "budget": t.budget, **({"floor": t.floor} if t.elastic else {}),
                      "policy": t.policy if t.compressed or t.elastic else None,
                      "auto": t.auto, "description": t.description}
                     for t in self.cfg.tiers if self.cfg.model_id(t.engine) == model and t.name in tenant.tiers]
            cards.append(ModelCard(id=model, tiers=tiers))
        return ModelList(data=cards)

    @app.get("/health")
    async def health(self, request: Request):
        """The service's view, for people and alerts, not probes (pods use pod_ready.py): 200 ok / 503 degraded
        (an engine deployment none of whose replicas can serve) to anyone; `open_mode` to a caller with a
        valid key; each engine's health and last error only to an admin tenant (or to everyone in open
        mode, where anyone may read /v1/kvtier/stats too)."""
        engines = {n: {"healthy": s.get("healthy", True), "error": s.get("error")}
                   for n, s in self.engine_health.state.items()}
        ok = all(e["healthy"] for e in engines.values())
        body: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        try:
            tenant = self.auth.tenant(request.headers.get("authorization"))
            body.update(open_mode=self.auth.open_mode, **({"engines": engines} if tenant.admin else {}))
        except AuthError:
            pass
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/kvtier/stats", responses=ERROR_RESPONSES)
    async def stats(self, request: Request, eviction: bool = False, ttft_since: float | None = None):
        """Admin tenants only (every caller in open mode): router counters, the engines' load (polled afresh
        for this call: KV pool free/total blocks, queue, each one's last error) and, with `?eviction=true`,
        each engine's kvtier eviction counters; with `?ttft_since=UNIX_TIME`, the time to first token of the
        requests that arrived since then, per tier, segment by segment (first_token.py)."""
        try:
            tenant = self.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            return error_response(401, exc.message, "unauthorized")
        if not tenant.admin:
            return error_response(403, f"tenant {tenant.name!r} may not read the service's statistics (an admin "
                                  "tenant's key may: tenants.<name>.admin)", "admin-only")
        out: dict[str, Any] = {"router": self.metrics.snapshot(), "engines": {}}
        if ttft_since is not None:
            out["ttft_breakdown"] = self.metrics.first_token_breakdown(ttft_since)
        for name in self.engines:
            await self.engine_health.poll_once(name)  # fresh numbers for callers that wait on them (tests, operators)
            out["engines"][name] = {k: v for k, v in self.engine_health.state[name].items()}
            if eviction:
                try:
                    ev = await asyncio.wait_for(self.engines[name].kvtier_eviction_stats.remote(), timeout=10)
                    out["engines"][name]["eviction"] = ev["engine"] if ev else None
                except Exception as exc:  # noqa: BLE001
                    out["engines"][name]["eviction"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return out
