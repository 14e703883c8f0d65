"""Whole SSE events for vLLM's benchmark client.

Why: vLLM 0.31's `vllm bench serve` completions client reads a stream with aiohttp's `iter_any()` and
strips each read before reassembling events. A read ends wherever the socket's data ended, which on a busy
box (the client descheduled while tokens pile up, client_clock.py) is often mid-event: a cut just after
`data:` loses the space the parser expects and the request is counted failed (JSONDecodeError; seen in
the goodput engine test under load), and a cut before a space inside the text drops the space from the
answer that is then graded. Upstream: vllm-project/vllm#51172 (open). Until vLLM ships it, `whole_events`
hands vLLM's unchanged request function a response whose `iter_any()` yields whole events only (the bytes
up to the last blank line; the rest waits for the next read), so no read boundary falls inside an event.
A token's time is when its event is complete, which is when a client could use it.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

EVENT_END = b"\n\n"
BACKEND = "openai"   # the backend bench_args names (vLLM's completions client)


async def event_aligned(reads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`reads` regrouped so that every item ends at an SSE event's end (the last partial event, if the
    stream ends inside one, comes last as is)."""
    pending = b""
    async for data in reads:
        pending += data
        cut = pending.rfind(EVENT_END)
        if cut >= 0:
            yield pending[:cut + len(EVENT_END)]
            pending = pending[cut + len(EVENT_END):]
    if pending:
        yield pending


class _Content:
    def __init__(self, content):
        self._content = content

    def iter_any(self) -> AsyncIterator[bytes]:
        return event_aligned(self._content.iter_any())

    def __getattr__(self, name):
        return getattr(self._content, name)


class _Response:
    def __init__(self, response):
        self._response, self.content = response, _Content(response.content)

    def __getattr__(self, name):
        return getattr(self._response, name)


class _Post:
    def __init__(self, request_cm):
        self._cm = request_cm

    async def __aenter__(self) -> _Response:
        return _Response(await self._cm.__aenter__())

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)


class _Session:
    """An aiohttp session whose `post` responses read whole events; everything else is the session's."""

    def __init__(self, session):
        self._session = session

    def post(self, *args, **kwargs) -> _Post:
        return _Post(self._session.post(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._session, name)


@contextlib.contextmanager
def whole_events():
    """For the body: vLLM's benchmark backend `openai` reads whole SSE events (its registry entry wraps
    its own request function; restored after)."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    original = funcs.ASYNC_REQUEST_FUNCS[BACKEND]

    async def request(request_func_input, session, pbar=None):
        return await original(request_func_input, _Session(session), pbar)

    funcs.ASYNC_REQUEST_FUNCS[BACKEND] = request
    try:
        yield
    finally:
        funcs.ASYNC_REQUEST_FUNCS[BACKEND] = original
