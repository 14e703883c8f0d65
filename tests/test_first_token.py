"""The router's time-to-first-token breakdown (kvtier.service.first_token, RouterMetrics): segments from the
hops' timestamps, what the replica's first item carries, and the per-tier summaries /v1/kvtier/stats
serves (`?ttft_since=`)."""

import time

from kvtier.service.first_token import first_item, segments, summarize, unwrap_first
from kvtier.service.metrics import RouterMetrics


def test_segments_are_the_gaps_between_hops_and_add_up():
    seg = segments(100.0, 100.002, {"replica_in": 100.005, "first_out": 100.105}, 100.108)
    assert {k: round(v, 6) for k, v in seg.items()} == {
        "route": 0.002, "to_replica": 0.003, "engine": 0.1, "to_router": 0.003, "total": 0.108}


def test_clock_skew_is_clipped_and_a_bare_first_item_folds_into_engine():
    # a replica whose clock runs 1 ms behind the router's: no negative hop
    seg = segments(10.0, 10.001, {"replica_in": 10.0005, "first_out": 10.05}, 10.06)
    assert seg["to_replica"] == 0.0 and min(seg.values()) >= 0.0
    bare = segments(10.0, 10.001, {}, 10.2)
    assert bare["to_replica"] == 0.0 and bare["to_router"] == 0.0 and round(bare["engine"], 6) == 0.199


def test_the_replicas_first_item_carries_its_timestamps():
    before = time.time()
    wrapped = first_item("data: {}\n\n", before - 0.5)
    item, times = unwrap_first(wrapped)
    assert item == "data: {}\n\n" and times["replica_in"] == before - 0.5 and times["first_out"] >= before
    assert unwrap_first({"response": {"id": 1}}) == ({"response": {"id": 1}}, {})
    assert unwrap_first("data: x\n\n") == ("data: x\n\n", {})


def test_summaries_per_tier_since_a_time():
    m = RouterMetrics(export=False)
    old = {"route": 9.0, "to_replica": 0, "engine": 0, "to_router": 0, "total": 9.0}
    m.first_token_segments("full", old)                       # arrived 9 s before it was recorded
    since = time.time() - 1.0
    for ms in range(1, 101):
        m.first_token_segments("k256", segments(0, 0.001, {"replica_in": 0.002, "first_out": 0.002 + ms / 1e3},
                                                0.003 + ms / 1e3))
    out = m.first_token_breakdown(since)
    assert set(out) == {"k256", "all"}                        # the old request arrived before `since`
    eng = out["k256"]["engine"]
    assert eng["n"] == 100 and eng["mean_ms"] == 50.5 and eng["p99_ms"] == 99.0
    assert out["k256"]["total"]["mean_ms"] == 53.5 and out["all"] == out["k256"]
    assert m.first_token_breakdown(time.time() + 60) == {}
    assert summarize([]) == {}


def test_a_streams_send_segment_is_recorded_once_its_first_chunk_went_out():
    """relay_stream records `send` (first chunk held by the router -> its send returned) once, after the
    consumer took the first chunk, outside `total`; a response with no stream has none."""
    import asyncio

    from kvtier.service.sse import relay_stream

    m = RouterMetrics(export=False)
    seg = segments(0, 0.001, {"replica_in": 0.002, "first_out": 0.010}, 0.011)
    m.first_token_segments("full", seg)

    async def rest():
        yield "data: {\"choices\": [{\"text\": \"b\"}]}\n\n"
        yield "data: [DONE]\n\n"

    async def consume():
        first_at = time.time()
        stream = relay_stream("data: {\"choices\": [{\"text\": \"a\"}]}\n\n", rest(), "cpu", "full",
                              time.perf_counter(), False, m, seg, first_at)
        out = [await stream.__anext__()]
        await asyncio.sleep(0.05)          # the "send" of the first chunk takes 50 ms
        out += [c async for c in stream]
        return out

    chunks = asyncio.run(consume())
    assert len(chunks) == 3 and chunks[-1] == "data: [DONE]\n\n"
    assert 0.045 <= seg["send"] < 1.0 and abs(seg["total"] - 0.011) < 1e-9   # total unchanged
    out = m.first_token_breakdown(time.time() - 60)["full"]
    assert out["send"]["n"] == 1 and out["send"]["mean_ms"] >= 45 and out["total"]["n"] == 1
    plain = segments(0, 0.001, {}, 0.002)
    assert "send" not in plain and "send" not in summarize([plain])
