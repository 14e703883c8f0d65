"""The compressed engine under vLLM's async scheduling (the GPU default), run on CPU.

vLLM's CPU platform switches async scheduling off ("not required"); these engines switch it back on
after that hook, so the scheduler is vLLM's `AsyncScheduler` with output placeholders and a batch queue
of two steps, as on a GPU. Checked: rounds run (placeholder-aware decode detection), log-probs after
rounds match the masked reference, the block bound holds, preemption recomputes correctly.
"""

import pytest

pytest.importorskip("vllm")

from engine_helpers import assert_matches_masked_reference, PROMPTS, greedy, records_for  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats, pool_state, scheduler_of  # noqa: E402

pytestmark = pytest.mark.engine

BUFFER = 16


@pytest.fixture(scope="module")
def async_scheduling():
    """Re-enable async scheduling after vLLM's CPU platform turned it off, for engines built here."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config):
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    yield
    CpuPlatform.check_and_update_config = original


@pytest.fixture(scope="module")
def engines():
    return []   # in-process engines stay alive until the module ends (see test_engine.py)


def build(tiny_model_dir, engines, **eviction_and_kw):
    kv_bytes = eviction_and_kw.pop("kv_cache_bytes", 32 << 20)
    llm = build_llm(tiny_model_dir, eviction=eviction_and_kw.pop("eviction"), kv_cache_bytes=kv_bytes,
                    max_model_len=2048 if kv_bytes >= 16 << 20 else 1024, max_num_seqs=16, enforce_eager=True,
                    **eviction_and_kw)
    engines.append(llm)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert type(scheduler_of(llm)).__name__ == "AsyncScheduler"
    return llm


def test_rounds_run_and_match_masked_reference_under_async_scheduling(async_scheduling, tiny_model_dir, tmp_path,
                                                                      engines, replay):
    audit = str(tmp_path / "keep.jsonl")
    llm = build(tiny_model_dir, engines, eviction={"default": {"buffer": BUFFER}, "audit_log": audit})
    before = pool_state(llm)
    budgets = [64, 112, 80]
    outs = llm.generate(PROMPTS, [greedy(300, logprobs=0, budget=b, seed=i) for i, b in enumerate(budgets)],
                        use_tqdm=False)
    stats = eviction_stats(llm)
    assert stats["engine"]["events"] > 0, "no eviction round ran under async scheduling"
    bs = before["block_size"]
    for out, budget in zip(outs, budgets):
        recs = records_for(audit, out.request_id)
        rounds = [r for r in recs if "kept" in r]
        assert len(rounds) >= 5, f"budget {budget}: only {len(rounds)} rounds"
        assert_matches_masked_reference(replay, out, recs, BUFFER, what=f"budget {budget}: ")
        rc = next(v for k, v in stats["requests"].items() if k.startswith(f"{out.request_id}-") or k == out.request_id)
        assert 0 < rc["peak_blocks"] <= -(-(budget + 2 * BUFFER) // bs), rc
    assert pool_state(llm)["free_blocks"] == before["free_blocks"]


def test_preemption_under_async_scheduling_recomputes_and_matches(async_scheduling, tiny_model_dir, tmp_path,
                                                                   engines, replay):
    """Stock admission, an 11-block pool: requests are preempted mid-flight (with a token in flight) and
    recomputed; every one completes and matches the masked reference, the pool returns to free."""
    audit = str(tmp_path / "keep.jsonl")
    llm = build(tiny_model_dir, engines, eviction={"default": {"buffer": BUFFER}, "admission": "vllm",
                                                   "audit_log": audit}, kv_cache_bytes=3 << 20)
    prompts = [PROMPTS[0] + f" request {i}" for i in range(6)]
    outs = llm.generate(prompts, [greedy(400, logprobs=0, budget=300, seed=i) for i in range(6)], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 400 for o in outs)
    st = eviction_stats(llm)["engine"]
    assert st["preemptions_compressed"] >= 1 and st["events"] > 0
    preempted = [o for o in outs if any("reset_row" in r for r in records_for(audit, o.request_id))]
    assert preempted, "no request was preempted"
    for o in preempted[:2]:
        assert_matches_masked_reference(replay, o, records_for(audit, o.request_id), BUFFER, control=False)
    assert pool_state(llm)["free_blocks"] == pool_state(llm)["total_blocks"]


def test_reserve_admission_under_async_scheduling_never_preempts(async_scheduling, tiny_model_dir, engines):
    llm = build(tiny_model_dir, engines, eviction={"default": {"buffer": BUFFER}, "admission": "reserve"},
                kv_cache_bytes=3 << 20)
    outs = llm.generate([PROMPTS[0] + f" {i}" for i in range(8)], [greedy(400, budget=200)] * 8, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 400 for o in outs)
    st = eviction_stats(llm)["engine"]
    assert st["preemptions_compressed"] == 0 and st["events"] > 0


def test_prefix_caching_under_async_scheduling(async_scheduling, tiny_model_dir, tmp_path, engines, replay):
    """Prefix caching with eviction (#26) under async scheduling: eight samples of one 300-token prompt,
    random K=320 with eight seeds; seven read the two protected prompt blocks, every sample evicts, one
    matches the masked reference, and the keep-sets are those of the same samples with cache reads skipped."""
    import random

    from vllm import SamplingParams

    from kvtier.engine.api import sampling_extra_args

    audit = str(tmp_path / "keep.jsonl")
    llm = build(tiny_model_dir, engines, eviction={"default": {"buffer": BUFFER}, "audit_log": audit},
                enable_prefix_caching=True)
    rng = random.Random(27)
    prompt = {"prompt_token_ids": [rng.randrange(3, 3000) for _ in range(300)]}

    def params(seed, skip):
        return SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, logprobs=0, skip_reading_prefix_cache=skip,
                              extra_args=sampling_extra_args(budget=320, seed=seed))

    cached = llm.generate([prompt] * 8, [params(s, False) for s in range(8)], use_tqdm=False)
    uncached = llm.generate([prompt] * 8, [params(s, True) for s in range(8)], use_tqdm=False)
    assert [o.num_cached_tokens for o in cached] == [0] + [256] * 7
    for c, u in zip(cached, uncached):
        kept = [r["kept"] for r in records_for(audit, c.request_id) if "kept" in r]
        assert len(kept) >= 3 and kept == [r["kept"] for r in records_for(audit, u.request_id) if "kept" in r]
    out = cached[5]
    assert_matches_masked_reference(replay, out, records_for(audit, out.request_id), BUFFER, prompt_len=300,
                                    control=False)
    assert pool_state(llm)["free_blocks"] == pool_state(llm)["total_blocks"]
