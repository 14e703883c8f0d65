"""`kvtier bench rollout` at a tiny size: one batch through verl's agent loop on the kvtier backend, compressed
vs full attention on one engine. The JSON is complete, both arms generate the same tokens, only the compressed
arm evicts and its requests are never preempted (reserve admission). No timings asserted: speed claims come
from the benchmark run itself (results/rollout-cpu-*.json)."""

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytest.importorskip("ray")

from test_benchmarks import run_json  # noqa: E402

pytestmark = pytest.mark.engine

SAMPLES, GEN = 3, 160


def test_bench_rollout_arms_generate_equal_tokens_and_only_random_evicts(tmp_path):
    out = tmp_path / "rollout.json"
    r = run_json(["bench", "rollout", "--samples", str(SAMPLES), "--gen-tokens", str(GEN), "--budget", "64",
                  "--buffer", "16", "--prompt-length", "64", "--full-seqs", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == r
    assert set(r) >= {"arms", "ratio", "workload", "valid", "checks"} and r["valid"], r["checks"]
    assert set(r["arms"]) == {"full", "random"}
    for arm in r["arms"].values():
        assert {"seconds", "tok_per_s", "preemptions", "eviction_events"} <= set(arm)
        assert arm["seconds"] > 0 and arm["tok_per_s"] > 0 and arm["preemptions"] >= 0
        assert arm["generated_tokens"] == SAMPLES * GEN
        assert arm["response_tokens"] == {"min": GEN, "max": GEN}        # ignore_eos: fixed lengths
    full, rnd = r["arms"]["full"], r["arms"]["random"]
    assert r["ratio"] == pytest.approx(rnd["tok_per_s"] / full["tok_per_s"])
    assert full["eviction_events"] == 0 and full["budgets"] == [None]
    # a round every r = 16 tokens past K + 2r = 96 (the prompt counts): several per sample
    assert rnd["eviction_events"] >= SAMPLES * 3 and rnd["tokens_evicted_per_head"] > 0 and rnd["budgets"] == [64]
    assert rnd["preemptions"] == 0 and rnd["preemptions_compressed"] == 0
    w = r["workload"]
    assert (w["samples"], w["gen_tokens"], w["budget"], w["policy"]) == (SAMPLES, GEN, 64, "random")
    assert w["pool"]["blocks"] == 2                                          # one (64 + 160)-token sequence
    assert w["concurrent_by_blocks"] == {"full": 1, "random": 2}
