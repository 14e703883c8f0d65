"""vLLM's benchmark client against a stream whose reads cut events (sse_reads.py): unaided it fails a cut
after `data:` and drops a space at a cut inside the text; through `whole_events` both come back whole."""

import asyncio
import json

import pytest

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvtier.benchmarks.sse_reads import event_aligned, whole_events  # noqa: E402


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}) + "\n\n"
# each list is one response's writes, a pause between them so the client reads each on its own
CUT_AFTER_DATA = ["data:", _event("A = 4")[5:] + _event(" so")[:-1], "\n" + _event(" B = 5") + USAGE + "data: [DONE]\n\n"]
CUT_BEFORE_SPACE = [_event("A = 4")[:-8], _event("A = 4")[-8:] + _event(" B")[:-4], _event(" B")[-4:] + USAGE
                    + "data: [DONE]\n\n"]


async def _serve(writes: list[str]):
    async def handler(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for part in writes:
            await resp.write(part.encode())
            await asyncio.sleep(0.05)
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _request(writes: list[str]):
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

    runner, port = await _serve(writes)
    try:
        async with aiohttp.ClientSession() as session:
            inp = RequestFuncInput(prompt="p", api_url=f"http://127.0.0.1:{port}/v1/completions", prompt_len=1,
                                   output_len=3, model="m")
            return await ASYNC_REQUEST_FUNCS["openai"](request_func_input=inp, session=session)
    finally:
        await runner.cleanup()


def test_vllms_client_mangles_events_cut_across_reads():
    """The bug this file works around (vllm-project/vllm#51172); when vLLM fixes it, this fails: drop sse_reads."""
    cut = asyncio.run(_request(CUT_AFTER_DATA))
    assert not cut.success and "JSONDecodeError" in cut.error
    spaced = asyncio.run(_request(CUT_BEFORE_SPACE))
    assert spaced.success and spaced.generated_text == "A =4 B"                # a space of the answer lost


@pytest.mark.parametrize("writes, text", [(CUT_AFTER_DATA, "A = 4 so B = 5"), (CUT_BEFORE_SPACE, "A = 4 B")])
def test_whole_events_give_vllms_client_every_event_intact(writes, text):
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS

    original = ASYNC_REQUEST_FUNCS["openai"]
    with whole_events():
        out = asyncio.run(_request(writes))
    assert ASYNC_REQUEST_FUNCS["openai"] is original                            # restored after
    assert out.success and out.generated_text == text and out.output_tokens == 3 and out.ttft > 0


def test_event_aligned_regroups_reads_at_event_ends():
    async def reads():
        for part in [b"data: {1}\n", b"\ndata: {2", b"}\n\ndata: {3}\n\n", b"data: {4"]:
            yield part

    async def collect():
        return [x async for x in event_aligned(reads())]

    assert asyncio.run(collect()) == [b"data: {1}\n\n", b"data: {2}\n\ndata: {3}\n\n", b"data: {4"]
