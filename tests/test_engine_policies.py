"""The scored baselines in the compressed vLLM engine on CPU (tiny Qwen3), one engine for the module.

Every policy runs in one batch at the same budget and cadence; its log-probs must equal the transformers
replay that masks exactly the logged keep-sets. H2O's accumulated attention in the engine (recomputed
from the kernel's queries and keys, moved with the slots) must equal the attention the reference model
puts on each held position, summed over every query since the position entered.
"""

import math

import pytest
import torch

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from engine_helpers import engine_logprobs, records_for  # noqa: E402
from kvtier.engine.api import build_llm, sampling_extra_args  # noqa: E402
from kvtier.engine.support import KVTierRequestError  # noqa: E402
from kvtier.policies.h2o import accumulated_attention  # noqa: E402

BUFFER = 16
BUDGET = 64
TOKENS = 200
PROMPT = "Let x = 42. Then the answer is \\boxed{x} and we continue to reason about it " * 2
POLICIES = ["h2o", "rkv", "vase", "triattention", "diverse", "random_reserve", "random_line_reserve"]


@pytest.fixture(scope="module")
def calibration_path(tiny_model_dir, tmp_path_factory):
    """A TriAttention calibration of the tiny model from its own decode steps (what `kvtier calibrate` does)."""
    from kvtier.policies.triattention_calibration import run_calibrate

    path = tmp_path_factory.mktemp("calib") / "tiny.safetensors"
    info = run_calibrate(tiny_model_dir, path, prompts=[PROMPT, "Hello world, the answer is "], tokens=48)
    assert (info["layers"], info["kv_heads"], info["head_dim"]) == (4, 2, 64)
    return str(path)


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit") / "keep.jsonl")


@pytest.fixture(scope="module")
def llm(tiny_model_dir, audit_path):
    return build_llm(tiny_model_dir, eviction={"default": {"buffer": BUFFER}, "audit_log": audit_path},
                     kv_cache_bytes=32 << 20, max_model_len=2048, max_num_seqs=16, enforce_eager=True)


def _kvtier_of(worker):
    return worker.model_runner.kvtier


def params(policy, calibration_path, **extra):
    kw = {"calibration": calibration_path} if policy == "triattention" else {}
    if policy == "random_line_reserve":   # K − p = 64 − 55 = 9 seats: one anchor of 3 (the default span needs 11)
        kw = {"reserve": 0.5, "span": 1}
    return SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0,
                          extra_args=sampling_extra_args(budget=BUDGET, policy=policy, buffer=BUFFER, seed=7,
                                                         params=kw or None, **extra))


@pytest.fixture(scope="module")
def batch(llm, calibration_path):
    """Every policy in one batch; H2O's accumulated attention recorded at each round before selection,
    random_line_reserve's reserved positions (its anchors' spans, from the request's state) after it."""
    ev = llm.collective_rpc(_kvtier_of)[0]
    rounds, reserved = [], {}
    select = ev._select_one

    def spy(op, st, pos, blocks):
        if op.spec.policy == "h2o":
            rounds.append({"query_position": op.query_position, "old_len": op.old_len,
                           "attention": st.attention[:, :, : op.old_len].clone(), "positions": pos.clone()})
        out = select(op, st, pos, blocks)
        if op.spec.policy == "random_line_reserve":
            mine, span = st.extras["random_line_reserve"], op.spec.make_policy().span
            anchors = mine["pos"][mine["score"] > float("-inf")]
            spans = (anchors.unsqueeze(1) + torch.arange(-span, span + 1)).flatten().tolist()
            reserved[op.query_position] = {p for p in spans if op.prompt_len <= p <= op.query_position - BUFFER}
        return out

    ev._select_one = spy
    try:
        outs = llm.generate([PROMPT] * len(POLICIES), [params(p, calibration_path) for p in POLICIES], use_tqdm=False)
    finally:
        del ev._select_one
    return dict(zip(POLICIES, outs)), rounds, reserved


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_masked_reference(batch, replay, audit_path, policy):
    out = batch[0][policy]
    recs = records_for(audit_path, out.request_id)
    rounds = [r for r in recs if "kept" in r]
    assert len(rounds) >= 3, f"{policy}: only {len(rounds)} rounds"
    assert all(r["policy"] == policy and r["budget"] == BUDGET for r in rounds)
    plen = len(out.prompt_token_ids)
    kept = torch.tensor(rounds[-1]["kept"])
    assert kept.shape == (4, 2, BUDGET)
    if policy in ("triattention", "random_reserve", "random_line_reserve"):  # protect the prompt by default
        assert (kept[..., :plen] == torch.arange(plen)).all()
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    err = (engine_logprobs(out) - replay.logprobs(ids, plen, recs, BUFFER)).abs()
    assert err.max() < 0.06, f"{policy}: max |engine - masked reference| = {err.max():.4f}"


def test_random_line_reserve_keeps_its_lines_in_every_layer_and_head(batch, audit_path):
    """The worker hands the policy the request's state (WorkerRequest.extras): each round's reserved
    positions are held by every (layer, KV head) in that round's audit record."""
    out, reserved = batch[0]["random_line_reserve"], batch[2]
    rounds = [r for r in records_for(audit_path, out.request_id) if "kept" in r]
    assert [r["query_position"] for r in rounds] == sorted(reserved) and any(reserved.values())
    for r in rounds:
        kept = torch.tensor(r["kept"]).flatten(0, 1).tolist()              # [L·H, K]
        assert all(reserved[r["query_position"]] <= set(row) for row in kept), r["query_position"]


def test_policies_choose_differently(batch, audit_path):
    """Each policy's keep-sets are its own (the engine handed each one what it reads). Over every round:
    random_line_reserve's first round can equal random_reserve's (both a uniform draw from one seed's
    generator while no reserved line is yet a candidate)."""
    first = {}
    for policy, out in batch[0].items():
        rounds = [r for r in records_for(audit_path, out.request_id) if "kept" in r]
        first[policy] = torch.stack([torch.tensor(r["kept"]) for r in rounds])
    for a in POLICIES:
        for b in POLICIES:
            if a < b:
                assert not torch.equal(first[a], first[b]), (a, b)


def reference_attention(replay, ids, records, upto):
    """[L, H_q, upto+1, upto+1] fp32 attention weights of the reference model with the engine's keep-sets
    applied (queries see what the compressed cache held at their step)."""
    n = upto + 1
    deaths = replay.deaths(records, n, BUFFER) if records else None
    att = replay.logits(ids[:n], deaths, output_attentions=True).attentions
    return torch.stack([a[0].float() for a in att])


def test_h2o_accumulated_attention_equals_reference_recomputation(batch, replay, audit_path):
    """At the first three rounds, the engine's per-slot sums equal Σ_t mean_group α_t(position) from the
    fp32 reference model over every query t since the start (prefill included), masked by the earlier
    keep-sets — so sums moved with their entries through hole filling and started at 0 in new slots."""
    out = batch[0]["h2o"]
    snaps = batch[1]
    assert len(snaps) >= 3
    recs = [r for r in records_for(audit_path, out.request_id) if "kept" in r]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    group = replay.group
    for i, snap in enumerate(snaps[:3]):
        qp = snap["query_position"]
        assert recs[i]["query_position"] == qp
        att = reference_attention(replay, ids, recs[:i], qp)            # [L, H_q, n, n]
        L, Hq, n, _ = att.shape
        ref_by_pos = att.sum(dim=2).view(L, Hq // group, group, n).mean(dim=2)   # [L, H, n]
        pos = snap["positions"]                                            # [L, H, old_len] slot -> position
        ref = ref_by_pos.gather(2, pos)
        eng = snap["attention"]
        assert eng.shape == ref.shape
        if i == 0:  # nothing evicted yet: every query put one unit of mass per (layer, KV head) on the cache
            assert torch.allclose(eng.sum(dim=2), torch.full(eng.shape[:2], float(n)), rtol=1e-4)
        # Later rounds: the mass on evicted entries left with them; what is held must match entry by entry.
        # Measured: max 0.3% of the largest sum, mean 0.2% (bf16 engine model vs fp32 reference model).
        rel = (eng - ref).abs().max() / ref.max()
        assert rel < 0.02, f"round {i + 1}: max |engine - reference| / max = {rel:.4f}"
        assert (eng - ref).abs().mean() < 0.01 * ref.mean(), f"round {i + 1}"


def test_accumulated_attention_is_causal_softmax_sum():
    """The recomputation on dense tensors, against a direct loop over queries (GQA, slots out of order,
    a query that sees nothing)."""
    g = torch.Generator().manual_seed(0)
    H, G, n, m, d = 2, 3, 12, 5, 8
    keys = torch.randn(H, n, d, generator=g)
    key_pos = torch.stack([torch.randperm(n, generator=g) + 3 for _ in range(H)])   # positions 3..14, shuffled
    queries = torch.randn(H * G, m, d, generator=g)
    query_pos = torch.tensor([2, 5, 9, 14, 14])                                      # the first sees nothing
    want = torch.zeros(H, n)
    for h in range(H):
        for t in range(m):
            vis = key_pos[h] <= query_pos[t]
            if not vis.any():
                continue
            for j in range(G):
                logits = keys[h][vis] @ queries[h * G + j, t] / math.sqrt(d)
                want[h, vis] += torch.softmax(logits, dim=0) / G
    got = accumulated_attention(keys, key_pos, queries, query_pos)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.sum(dim=1), torch.full((H,), 4.0))                     # 4 queries see something
    # Blocked evaluation (long prefills) gives the same sums.
    import kvtier.policies.h2o as h2o

    old, h2o._BLOCK_ELEMENTS = h2o._BLOCK_ELEMENTS, 1
    try:
        assert torch.allclose(accumulated_attention(keys, key_pos, queries, query_pos), want, atol=1e-6)
    finally:
        h2o._BLOCK_ELEMENTS = old


def test_triattention_without_or_with_a_mismatched_calibration_is_rejected(llm, tmp_path):
    from kvtier.engine.config import EvictionSpec, validate_request
    from kvtier.policies.triattention import TriAttentionCalibration, save_calibration

    with pytest.raises(KVTierRequestError, match="needs a calibration"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, extra_args=sampling_extra_args(budget=BUDGET, policy="triattention")),
                     use_tqdm=False)
    with pytest.raises(KVTierRequestError, match="calibration"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, extra_args=sampling_extra_args(
            budget=BUDGET, policy="triattention", params={"calibration": str(tmp_path / "missing.safetensors")})),
            use_tqdm=False)
    wrong = TriAttentionCalibration(torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), torch.ones(32))
    save_calibration(wrong, tmp_path / "wrong.safetensors")
    spec = EvictionSpec(budget=BUDGET, policy="triattention", params={"calibration": str(tmp_path / "wrong.safetensors")})
    with pytest.raises(Exception, match="2 layers"):
        validate_request(spec, 10, num_layers=4, num_kv_heads=2, head_dim=64)
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_random_reserve_is_served_like_random_outside_selection():
    """No keyed draw (select_one gathers its keys), no query capture, so full CUDA graphs and the prefix
    cache stay as random's: it caches and reads its protected prompt's whole blocks."""
    from kvtier.engine.allowlist import captured_needs
    from kvtier.engine.config import EvictionSpec
    from kvtier.engine.scheduler_side import prefix_cache_caps
    from kvtier.engine.victim_selection import keyed_draw

    spec = EvictionSpec(budget=BUDGET, policy="random_reserve", buffer=BUFFER, params={"reserve": 0.1})
    assert not keyed_draw(spec.make_policy()) and captured_needs("random_reserve") == frozenset()
    assert prefix_cache_caps(spec, 300, 128) == prefix_cache_caps(EvictionSpec(budget=BUDGET), 300, 128) == (256, 256)


def test_rounds_bench_times_every_policy():
    """`kvtier bench rounds` covers every registered policy on its stacked-layer cache (TriAttention with a
    synthetic calibration, H2O with its per-round attention recomputation)."""
    from kvtier.benchmarks.rounds import RoundShapes, run_rounds_bench
    from kvtier.policies import available

    r = run_rounds_bench(RoundShapes(layers=2, kv_heads=2, head_dim=32, budget=48, buffer=16, query_heads=4,
                                     prompt_len=8), repeats=1)
    assert set(r["policies"]) == set(available())
    for name, res in r["policies"].items():
        assert res.get("ms_per_round", 0) > 0, (name, res)
