"""Stream chunk coalescing for the engine replica's `kvtier_generate`: every chunk is one Ray object per hop,
so chunks are grouped into sends (what that saves: this package's README, on the serving path's cost)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator


async def coalesce(stream: AsyncIterator[Any], interval_s: float) -> AsyncIterator[list]:
    """The stream's items as lists: the first item alone and at once (time to first token is the engine's),
    then everything that arrived since, at most once per interval_s, and the rest as soon as the stream
    ends. A reader task drains the engine's stream meanwhile, so a slow consumer never slows the engine's
    output handler."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def read() -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(end)

    reader = asyncio.ensure_future(read())
    loop = asyncio.get_running_loop()
    try:
        first, sent_at = True, loop.time()
        while True:
            batch = [await queue.get()]
            if not first:   # wait out the interval (or the stream's end: the last tokens never wait)
                await asyncio.wait({reader}, timeout=max(0.0, sent_at + interval_s - loop.time()))
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = any(x is end for x in batch)
            error = next((x for x in batch if isinstance(x, BaseException)), None)
            flat = [y for x in batch if x is not end and not isinstance(x, BaseException)
                    for y in (x if isinstance(x, list) else [x])]
            if flat:
                yield flat
            if error is not None:
                raise error
            first, sent_at = False, loop.time()
            if done:
                return
    finally:
        reader.cancel()
