"""The router's errors: OpenAI-style error bodies (`{"error": {message, type, param, code}}` with the
stable reason code in `x-kvtier-reason`), and what an engine failure means to the client: gone or
restarting -> 503 with `retry-after`, too slow -> 504, a bug in the engine deployment -> 500.

No FastAPI app or deployment here; Ray's exception types are imported when a failure is classified.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import JSONResponse

from .api_models import ErrorBody

logger = logging.getLogger("kvtier.service")

ERROR_RESPONSES = {s: {"model": ErrorBody} for s in (400, 401, 403, 404, 429, 500, 503, 504)}


class ServeError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, reason: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.param, self.headers = status, message, reason, param, headers or {}


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
            504: "timeout"}.get(status, "server_error")


def error_response(status: int, message: str, reason: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": reason}}
    return JSONResponse(body, status_code=status, headers={"x-kvtier-reason": reason, **(headers or {})})


def is_dead(exc: BaseException) -> bool:
    """The engine's actor is gone (died, or unreachable)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


def looks_dead(message: str) -> bool:
    """vLLM's words for an engine core that has died."""
    return any(s in message for s in ("EngineDead", "EngineCore encountered an issue", "engine is dead"))


def engine_failure(exc: BaseException, engine: str) -> ServeError:
    """The error a client gets for an engine call that raised `exc`."""
    from ray.exceptions import RayError, RayTaskError

    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return ServeError(504, f"engine {engine!r} did not answer in time", "engine-timeout")
    if is_dead(exc) or looks_dead(str(exc)):
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
