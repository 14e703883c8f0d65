"""Whole SSE events for vLLM's benchmark client, and error events counted as failures.

Why: vLLM 0.31's `vllm bench serve` completions client reads a stream with aiohttp's `iter_any()` and
strips each read before reassembling events. A read ends wherever the socket's data ended, which on a busy
box (the client descheduled while tokens pile up, client_clock.py) is often mid-event: a cut just after
`data:` loses the space the parser expects and the request is counted failed (JSONDecodeError; seen in
the goodput engine test under load), and a cut before a space inside the text drops the space from the
answer that is then graded. Upstream: vllm-project/vllm#51172 (open). Until vLLM ships it, `whole_events`
hands vLLM's unchanged request function a response whose `iter_any()` yields whole events only (the bytes
up to the last blank line; the rest waits for the next read), so no read boundary falls inside an event.
A token's time is when its event is complete, which is when a client could use it.

The same client skips an event with no `choices` and no `usage`, so a server's `data: {"error": ...}` event
mid-stream (vLLM's server and kvtier's router both send one when generation fails after the first token)
leaves a cut-short text counted a success. The wrapper sees every event: such a request is marked failed
with the event's message.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import AsyncIterator

EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")   # SSE's blank line, in any of its line endings
BACKEND = "openai"   # the backend bench_args names (vLLM's completions client)


def error_events(chunk: bytes) -> list[str]:
    """The messages of the `data: {"error": ...}` events in `chunk` (whole events)."""
    found = []
    for event in EVENT_END.split(chunk):
        data = event.strip().removeprefix(b"data:").strip()
        if data.startswith(b"{") and b'"error"' in data:
            try:
                body = json.loads(data)
            except ValueError:
                continue
            if isinstance(body, dict) and "error" in body and not body.get("choices"):
                err = body["error"]
                found.append(str(err.get("message", err) if isinstance(err, dict) else err))
    return found


async def event_aligned(reads: AsyncIterator[bytes], errors: list[str] | None = None) -> AsyncIterator[bytes]:
    """`reads` regrouped so that every item ends at an SSE event's end (the last partial event, if the
    stream ends inside one, comes last as is); the messages of error events go to `errors`."""
    pending = b""
    async for data in reads:
        pending += data
        ends = list(EVENT_END.finditer(pending))
        if ends:
            cut = ends[-1].end()
            whole, pending = pending[:cut], pending[cut:]
            if errors is not None:
                errors += error_events(whole)
            yield whole
    if pending:
        yield pending


class _Content:
    def __init__(self, content, errors: list[str]):
        self._content, self._errors = content, errors

    def iter_any(self) -> AsyncIterator[bytes]:
        return event_aligned(self._content.iter_any(), self._errors)

    def __getattr__(self, name):
        return getattr(self._content, name)


class _Response:
    def __init__(self, response, errors: list[str]):
        self._response, self.content = response, _Content(response.content, errors)

    def __getattr__(self, name):
        return getattr(self._response, name)


class _Post:
    def __init__(self, request_cm, errors: list[str]):
        self._cm, self._errors = request_cm, errors

    async def __aenter__(self) -> _Response:
        return _Response(await self._cm.__aenter__(), self._errors)

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)


class _Session:
    """An aiohttp session whose `post` responses read whole events and collect error events' messages in
    `errors`; everything else is the session's."""

    def __init__(self, session):
        self._session, self.errors = session, []

    def post(self, *args, **kwargs) -> _Post:
        return _Post(self._session.post(*args, **kwargs), self.errors)

    def __getattr__(self, name):
        return getattr(self._session, name)


@contextlib.contextmanager
def whole_events():
    """For the body: vLLM's benchmark backend `openai` reads whole SSE events and fails a request whose
    stream carried an error event (its registry entry wraps its own request function; restored after)."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    original = funcs.ASYNC_REQUEST_FUNCS[BACKEND]

    async def request(request_func_input, session, pbar=None):
        wrapped = _Session(session)
        output = await original(request_func_input, wrapped, pbar)
        if wrapped.errors and output.success:
            output.success, output.error = False, f"SSE error event: {wrapped.errors[0]}"
        return output

    funcs.ASYNC_REQUEST_FUNCS[BACKEND] = request
    try:
        yield
    finally:
        funcs.ASYNC_REQUEST_FUNCS[BACKEND] = original
