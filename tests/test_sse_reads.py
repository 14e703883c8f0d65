"""vLLM's benchmark client against streams whose reads cut events, or that carry an error event
(sse_reads.py): unaided it fails a cut after `data:`, drops a space at a cut inside the text and counts an
error event's cut-short text a success; through `whole_events` all three come back right. The reads are
handed over exactly as listed (a fake session, no socket), so the cuts fall where the test puts them."""

import asyncio
import json

import pytest

pytest.importorskip("vllm")

from kvtier.benchmarks.sse_reads import event_aligned, whole_events  # noqa: E402


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"


END = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}) + "\n\ndata: [DONE]\n\n"
# each list is one response's socket reads
CUT_AFTER_DATA = ["data:", _event("A = 4")[5:] + _event(" so")[:-1], "\n" + _event(" B = 5") + END]
CUT_BEFORE_SPACE = [_event("A = 4")[:-8], _event("A = 4")[-8:] + _event(" B")[:-4], _event(" B")[-4:] + END]
ERROR_MID_STREAM = [_event("A = 4"), 'data: {"error": {"message": "engine died", "code": 503}}\n\n', "data: [DONE]\n\n"]


class _Content:
    def __init__(self, reads):
        self.reads = reads

    async def iter_any(self):
        for r in self.reads:
            yield r.encode()


class _Response:
    status, reason = 200, "OK"

    def __init__(self, reads):
        self.content = _Content(reads)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None


class _FakeSession:
    def __init__(self, reads):
        self.reads = reads

    def post(self, **kwargs):
        return _Response(self.reads)


def _request(reads):
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

    inp = RequestFuncInput(prompt="p", api_url="http://127.0.0.1:1/v1/completions", prompt_len=1, output_len=3,
                           model="m")
    return asyncio.run(ASYNC_REQUEST_FUNCS["openai"](request_func_input=inp, session=_FakeSession(reads)))


def test_vllms_client_mangles_cut_events_and_passes_error_events():
    """The faults this file works around (vllm-project/vllm#51172); when vLLM fixes them, this fails: drop sse_reads."""
    cut = _request(CUT_AFTER_DATA)
    assert not cut.success and "JSONDecodeError" in cut.error
    spaced = _request(CUT_BEFORE_SPACE)
    assert spaced.success and spaced.generated_text == "A =4 B"                # a space of the answer lost
    errored = _request(ERROR_MID_STREAM)
    assert errored.success and errored.generated_text == "A = 4"              # a cut-short text, "success"


@pytest.mark.parametrize("reads, text", [(CUT_AFTER_DATA, "A = 4 so B = 5"), (CUT_BEFORE_SPACE, "A = 4 B")])
def test_whole_events_give_vllms_client_every_event_intact(reads, text):
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS

    original = ASYNC_REQUEST_FUNCS["openai"]
    with whole_events():
        out = _request(reads)
    assert ASYNC_REQUEST_FUNCS["openai"] is original                            # restored after
    assert out.success and out.generated_text == text and out.output_tokens == 3 and out.ttft > 0


def test_whole_events_fail_a_stream_that_carried_an_error_event():
    with whole_events():
        out = _request(ERROR_MID_STREAM)
    assert not out.success and out.error == "SSE error event: engine died"


def test_event_aligned_regroups_reads_at_event_ends_in_any_line_ending():
    async def collect(parts):
        async def reads():
            for part in parts:
                yield part
        errors = []
        return [x async for x in event_aligned(reads(), errors)], errors

    assert asyncio.run(collect([b"data: {1}\n", b"\ndata: {2", b"}\n\ndata: {3}\n\n", b"data: {4"])) == (
        [b"data: {1}\n\n", b"data: {2}\n\ndata: {3}\n\n", b"data: {4"], [])
    assert asyncio.run(collect([b"data: {1}\r\n\r\ndata: {2", b'}\r\n\r\ndata: {"error": "x"}\r\n\r\n'])) == (
        [b"data: {1}\r\n\r\n", b'data: {2}\r\n\r\ndata: {"error": "x"}\r\n\r\n'], ["x"])
