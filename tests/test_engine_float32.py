"""The compressed engine in float32 (what a CPU without AVX512-BF16/AMX should run: engine/cpu_dtype.py).
The KV cache follows the model's dtype, so compaction moves 4-byte entries through the probed layout; the
log-probs must then match the fp32 masked reference far more tightly than a bf16 engine can."""

import pytest
import torch

pytest.importorskip("vllm")
from engine_helpers import PROMPTS, assert_matches_masked_reference, greedy, records_for  # noqa: E402
from kvtier.engine.api import build_llm, eviction_stats, pool_state  # noqa: E402

pytestmark = pytest.mark.engine
BUFFER = 16
FP32_TOL = 2e-3   # fp32 engine vs fp32 reference: kernel summation order only (bf16 needs 0.06)


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit") / "keep.jsonl")


@pytest.fixture(scope="module")
def llm32(tiny_model_dir, audit_path):
    return build_llm(tiny_model_dir, eviction={"default": {"policy": "random", "buffer": BUFFER}, "audit_log": audit_path},
                     kv_cache_bytes=16 << 20, max_model_len=1024, max_num_seqs=4, enforce_eager=True, dtype="float32")


def test_float32_engine_evicts_and_matches_the_masked_reference_tightly(llm32, replay, audit_path):
    assert llm32.llm_engine.model_config.dtype == torch.float32
    # 16 MiB at 4 KiB per fp32 token (4 layers x 2 KV heads x 64 x K,V x 4 bytes) = 4096 tokens = 32 blocks,
    # one of them vLLM's null block (a bf16 engine would have 64)
    assert pool_state(llm32)["total_blocks"] == 31
    out = llm32.generate(PROMPTS[:1], [greedy(200, logprobs=0, budget=64)], use_tqdm=False)[0]
    recs = records_for(audit_path, out.request_id)
    assert len([r for r in recs if "kept" in r]) >= 5
    assert eviction_stats(llm32)["engine"]["events"] >= 5
    assert_matches_masked_reference(replay, out, recs, BUFFER, tol=FP32_TOL, what="float32: ")
    assert pool_state(llm32)["free_blocks"] == 31
