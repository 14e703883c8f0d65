"""Attention under a recorded eviction (kvtier.deathtime): the records, the attention function and its
agreement with both engines, gradients, padding, and FlexAttention.

CPU, tiny Qwen3; the engine test shares one vLLM engine for the module.
"""

import itertools
import types

import pytest
import torch

from kvtier.deathtime import (ATTN_NAME, NEVER, RebuiltCacheError, deaths_from_rounds, place_in_batch, register,
                              round_positions, simulate_deaths, visibility)
from kvtier.deathtime import attention as dt_attention
from kvtier.engine.config import EvictionSpec
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.reference import Request

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_visibility_is_the_death_rule():
    """Key j visible to query i iff j <= i < deaths[j], checked cell by cell."""
    deaths = torch.tensor([NEVER, 3, 5, NEVER, NEVER, 6], dtype=torch.int32)
    vis = visibility(deaths)
    for i in range(6):
        for j in range(6):
            assert bool(vis[i, j]) == (j <= i < int(deaths[j])), (i, j)


@pytest.mark.parametrize("q_len, with_base", [(7, False), (7, True), (3, True), (1, False)])
def test_a_layers_mask_is_the_death_rule_and_the_models_mask(q_len, with_base):
    """layer_mask, cell by cell: (j <= i < deaths[j] and the model's mask) or j == i, for the last q_len queries
    (a prefill, a chunk, a decode step)."""
    from kvtier.deathtime.attention import layer_mask

    g = torch.Generator().manual_seed(3)
    B, H, T = 2, 3, 7
    deaths = torch.randint(1, T + 1, (B, H, T), generator=g, dtype=torch.int32)
    deaths[0, 0, 2] = NEVER
    base = torch.rand(B, 1, q_len, T, generator=g) > 0.3 if with_base else None
    vis = layer_mask(deaths, base, q_len)
    assert vis.shape == (B, H, q_len, T) and vis.dtype == torch.bool
    for b, h, qi, j in itertools.product(range(B), range(H), range(q_len), range(T)):
        i = T - q_len + qi
        want = (j <= i < int(deaths[b, h, j]) and (base is None or bool(base[b, 0, qi, j]))) or j == i
        assert bool(vis[b, h, qi, j]) == want, (b, h, qi, j)


def test_deaths_from_rounds_by_hand():
    """Two rounds, r = 2: what is neither kept nor in the buffer dies at the round's query_position + 1,
    once; the r newest are never candidates."""
    rounds = [{"query_position": 5, "kept": [[[0, 1, 3]]]},          # cached 0..5; buffer 4, 5; 2 dies at 6
              {"query_position": 7, "kept": [[[0, 3, 4]]]}]          # cached 0,1,3..7; buffer 6, 7; 1, 5 die at 8
    d = deaths_from_rounds(rounds, 1, 1, 10, buffer=2)[0, 0].tolist()
    assert d == [NEVER, 8, 6, NEVER, NEVER, 8, NEVER, NEVER, NEVER, NEVER]


def test_a_rebuilt_cache_is_refused():
    rounds = [{"query_position": 5, "kept": [[[0, 1, 3]]]}, {"reset_row": 7}]
    with pytest.raises(RebuiltCacheError):
        deaths_from_rounds(rounds, 1, 1, 10, buffer=2)
    # a reset before any round (a preemption during the prefill or the first r steps) changes nothing
    assert deaths_from_rounds([{"reset_row": 3}] + rounds[:1], 1, 1, 10, buffer=2)[0, 0, 2] == 6


def test_round_positions_follow_the_schedule():
    """K = 8, r = 4, prompt 10: the first round is on the cadence (4 decoded) once the cache holds more
    than K + r = 12 entries (query_position 13); then every r steps."""
    s = EvictionSchedule(budget=8, buffer=4)
    qps = round_positions(s, 10, 40)
    assert qps[0] == 13 and all(b - a == 4 for a, b in zip(qps, qps[1:]))


@pytest.mark.parametrize("policy,spec", [
    ("random", EvictionSpec(policy="random", budget=48, buffer=16, seed=1)),
    ("streaming", EvictionSpec(policy="streaming", budget=40, buffer=8, seed=3)),
    ("random", EvictionSpec(policy="random", budget=24, buffer=8, seed=5, protect_prompt=False, sinks=2)),
])
def test_simulated_deaths_equal_the_reference_engines_rounds(ref, policy, spec):
    """simulate_deaths (no model) gives exactly the deaths of the reference engine's logged rounds."""
    prompt = list(range(10, 40))
    out = ref.generate([Request(prompt, spec, max_new_tokens=120)])[0]
    n = len(prompt) + len(out.token_ids)
    got = simulate_deaths(spec.make_policy(), spec.schedule(), len(prompt), n, num_layers=4, num_kv_heads=2,
                          seed=spec.seed)
    want = deaths_from_rounds(out.records, 4, 2, n, spec.buffer)
    assert out.rounds >= 4
    assert torch.equal(got, want)


def test_simulating_a_policy_that_reads_the_cache_is_refused():
    with pytest.raises(ValueError, match="snapkv"):
        simulate_deaths(make_policy("snapkv"), EvictionSchedule(32, 8), 10, 100, num_layers=1, num_kv_heads=1, seed=0)


@pytest.fixture(scope="module")
def deathtime_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    register()
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTN_NAME).eval()


def _token_logprobs(logits, ids, start):
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[start - 1 : len(ids) - 1].gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("spec", [EvictionSpec(policy="random", budget=40, buffer=16, seed=2),
                                  EvictionSpec(policy="snapkv", budget=40, buffer=16)])
def test_reference_engine_logprobs_equal_deathtime_attention(ref, deathtime_model, spec):
    """The reference engine decoding over a compacted cache, and one forward under its deaths: same
    log-probs (fp32); without the deaths they differ (the comparison has power)."""
    prompt = list(range(100, 130))
    out = ref.generate([Request(prompt, spec, max_new_tokens=140)])[0]
    ids = prompt + out.token_ids
    deaths = deaths_from_rounds(out.records, 4, 2, len(ids), spec.buffer)
    with torch.no_grad():
        under = deathtime_model(input_ids=torch.tensor([ids]), kvtier_deaths=deaths.unsqueeze(0)).logits[0]
        plain = deathtime_model(input_ids=torch.tensor([ids])).logits[0]
    got = torch.tensor(out.logprobs)
    assert (got - _token_logprobs(under, ids, len(prompt))).abs().max() < 1e-3
    assert (got - _token_logprobs(plain, ids, len(prompt))).abs().max() > 0.3


def test_padded_batch_equals_each_sample_alone(deathtime_model):
    """Left-padded batch of two samples of different lengths, one under eviction and one under full
    attention: each sample's logits equal its own unpadded forward."""
    sched = EvictionSchedule(budget=24, buffer=8)
    a, b = list(range(10, 130)), list(range(50, 110))
    da = simulate_deaths(make_policy("random"), sched, 20, len(a), num_layers=4, num_kv_heads=2, seed=9)
    T = len(a)
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    ids[0], mask[0] = torch.tensor(a), 1
    ids[1, T - len(b):], mask[1, T - len(b):] = torch.tensor(b), 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    deaths = place_in_batch([da, None], T, [0, T - len(b)])
    with torch.no_grad():
        both = deathtime_model(input_ids=ids, attention_mask=mask, position_ids=pos, kvtier_deaths=deaths).logits
        alone_a = deathtime_model(input_ids=ids[:1], kvtier_deaths=da.unsqueeze(0)).logits[0]
        alone_b = deathtime_model(input_ids=torch.tensor([b])).logits[0]
    assert torch.allclose(both[0], alone_a, atol=1e-4)
    assert torch.allclose(both[1, T - len(b):], alone_b, atol=1e-4)
    assert torch.isfinite(both).all()


def _tiny_float64_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    register()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    cfg._attn_implementation = ATTN_NAME
    return Qwen3ForCausalLM(cfg).double()


def test_gradients_match_finite_differences():
    """The attention op's gradient (torch.autograd.gradcheck, float64), and d loss / d weight of a whole
    model under a recorded eviction against a central difference along a random direction, for an
    attention weight and an MLP weight (Qwen3's RMSNorm and RoPE compute in float32, hence eps 1e-4 and
    a relative tolerance of 1e-3, far below how much the deaths change the gradient)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 10, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    d_op = torch.full((1, 1, 2, 10), NEVER, dtype=torch.int32)
    d_op[0, 0, 0, 1:4] = torch.tensor([5, 6, 8], dtype=torch.int32)
    layer = types.SimpleNamespace(layer_idx=0, training=False)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dt_attention.deathtime_attention(layer, q, k, v, None, kvtier_deaths=d_op)[0], (q, k, v))

    model = _tiny_float64_model()
    ids = torch.randint(0, 40, (2, 48), generator=torch.Generator().manual_seed(1))
    sched = EvictionSchedule(budget=12, buffer=4)
    deaths = torch.stack([simulate_deaths(make_policy("random"), sched, 8, 48, num_layers=2, num_kv_heads=2,
                                          seed=s) for s in (0, 1)])

    def loss(d=deaths):                 # in float64 (transformers' own loss upcasts to float32 only)
        logits = model(input_ids=ids, kvtier_deaths=d).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1))

    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        w = dict(model.named_parameters())[name]
        model.zero_grad()
        loss().backward()
        u = torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        analytic = float((w.grad * u).sum())
        eps = 1e-4
        with torch.no_grad():
            w += eps * u
            up = float(loss())
            w -= 2 * eps * u
            down = float(loss())
            w += eps * u
        numeric = (up - down) / (2 * eps)
        assert abs(analytic - numeric) < 1e-3 * max(1e-2, abs(numeric)), (name, analytic, numeric)
    # the same directional derivative under full attention is another number: the deaths matter
    w = dict(model.named_parameters())["model.layers.0.self_attn.k_proj.weight"]
    u = torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for d in (deaths, torch.full_like(deaths, NEVER)):
        model.zero_grad()
        loss(d).backward()
        grads.append(float((w.grad * u).sum()))
    assert abs(grads[0] - grads[1]) > 0.05 * abs(grads[0])


@pytest.mark.parametrize("q_len, mask", [(23, "rows"), (6, "rows"), (23, "one row"), (6, None)])
def test_query_chunks_compute_the_whole_masks_attention(monkeypatch, q_len, mask):
    """The mask path in query chunks (QUERY_CHUNK forced to 5: chunks of 5, 5, ..., 3 over keys cut at each
    chunk's last query) gives the one-mask softmax, float64, with GQA, for a prefill and a later chunk of
    queries, under the model's mask with its own rows (causal, left padding, holes that differ by row), one row
    for every query, or none; its gradient passes gradcheck; a mask with other rows is refused."""
    g = torch.Generator().manual_seed(4)
    B, Hq, H, T, d = 2, 4, 2, 23, 8
    q = torch.randn(B, Hq, q_len, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    deaths = torch.full((B, 1, H, T), NEVER, dtype=torch.int32)
    deaths[:, 0, :, 3:15] = torch.randint(12, T, (B, H, 12), generator=g, dtype=torch.int32)
    base = torch.ones(B, 1, q_len, T, dtype=torch.bool).tril(T - q_len)
    base[1, :, :, :4] = False                                  # sample 1: 4 left-padding keys
    base &= torch.rand(B, 1, q_len, T, generator=g) > 0.2      # holes that differ by row: a wrong row slice shows
    if mask == "one row":
        base = base[:, :, -1:]
    elif mask is None:
        base = None
    layer = types.SimpleNamespace(layer_idx=0, training=False)

    def one_mask(base):                                        # [B, q, Hq, d]: one softmax over the whole mask
        vis = dt_attention.layer_mask(deaths[:, 0], base, q_len).repeat_interleave(Hq // H, dim=1)
        kk, vv = (x.repeat_interleave(Hq // H, dim=1) for x in (k, v))
        w = torch.softmax((q @ kk.transpose(2, 3) * d ** -0.5).masked_fill(~vis, float("-inf")), dim=-1)
        return (w @ vv).transpose(1, 2)

    monkeypatch.setattr(dt_attention, "QUERY_CHUNK", 5)
    got, _ = dt_attention.deathtime_attention(layer, q, k, v, base, kvtier_deaths=deaths)
    assert torch.allclose(got, one_mask(base), atol=1e-12)
    if base is not None:                                       # the model's mask mattered: cut per chunk, not lost
        assert not torch.allclose(got, one_mask(None), atol=1e-3)
    assert torch.autograd.gradcheck(            # fast mode: a random projection of the Jacobian, not all of it
        lambda q, k, v: dt_attention.deathtime_attention(layer, q, k, v, base, kvtier_deaths=deaths)[0], (q, k, v),
        fast_mode=True)
    with pytest.raises(ValueError, match="query rows"):
        dt_attention.deathtime_attention(layer, q, k, v, torch.ones(B, 1, q_len + 1, T, dtype=torch.bool),
                                         kvtier_deaths=deaths)


def test_flex_attention_forward_agrees_with_the_mask_path(monkeypatch):
    """The CUDA path (FlexAttention with a mask_mod over the deaths) forced on CPU: same output as the
    boolean-mask SDPA path, with GQA and padding."""
    g = torch.Generator().manual_seed(0)
    B, Hq, H, T, d = 2, 4, 2, 48, 16
    q, k, v = (torch.randn(B, h, T, d, generator=g) for h in (Hq, H, H))
    deaths = torch.full((B, 1, H, T), NEVER, dtype=torch.int32)
    deaths[:, 0, :, 4:24] = torch.randint(26, 48, (B, H, 20), generator=g, dtype=torch.int32)
    base = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    base[1, :, :, :6] = False                                  # sample 1: 6 left-padding keys
    layer = types.SimpleNamespace(layer_idx=0, training=False)
    want, _ = dt_attention.deathtime_attention(layer, q, k, v, base, kvtier_deaths=deaths)
    monkeypatch.setitem(dt_attention.BACKEND, "cpu", "flex")
    got, _ = dt_attention.deathtime_attention(layer, q, k, v, base, kvtier_deaths=deaths)
    assert torch.allclose(got, want, atol=1e-5)
    # under bf16 autocast with fp32 q, k beside a bf16 v (what Qwen3's q/k norms hand over), flex gets one dtype,
    # autocast's (torch 2.11's compiled flex refuses mixed ones; SDPA casts by itself)
    seen, flex = [], dt_attention._flex
    monkeypatch.setattr(dt_attention, "_flex", lambda q_, k_, v_, *a: seen.append((q_.dtype, k_.dtype, v_.dtype)) or flex(q_, k_, v_, *a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = dt_attention.deathtime_attention(layer, q, k, v.to(torch.bfloat16), base, kvtier_deaths=deaths)
    assert seen == [(torch.bfloat16,) * 3] and torch.allclose(mixed.float(), want, atol=3e-2)


@pytest.fixture(scope="module")
def engine_batch(tiny_model_dir, tmp_path_factory):
    """One in-process vLLM engine; random and snapkv requests in one batch, with the keep-set audit log."""
    pytest.importorskip("vllm")
    from engine_helpers import greedy
    from kvtier.engine.api import build_llm

    audit = str(tmp_path_factory.mktemp("audit") / "keep.jsonl")
    llm = build_llm(tiny_model_dir, eviction={"default": {"buffer": 16}, "audit_log": audit},
                    kv_cache_bytes=32 << 20, max_model_len=1024, max_num_seqs=8, enforce_eager=True)
    prompt = "A long chain of thought begins here: first we note that seven times six is forty two, "
    specs = [dict(policy="random", budget=48, buffer=16, seed=11), dict(policy="snapkv", budget=48, buffer=16)]
    outs = llm.generate([prompt] * 2, [greedy(160, logprobs=0, **s) for s in specs], use_tqdm=False)
    yield dict(zip(("random", "snapkv"), outs)), audit
    del llm


@pytest.mark.engine
@pytest.mark.parametrize("policy", ["random", "snapkv"])
def test_vllm_engine_logprobs_equal_deathtime_attention(engine_batch, deathtime_model, policy):
    """The compressed vLLM engine (bf16, paged, hole filling) and one fp32 forward under the deaths of
    its audit log agree within the oracle's tolerance; without the deaths they do not."""
    from engine_helpers import engine_logprobs, records_for

    outs, audit = engine_batch
    out = outs[policy]
    recs = records_for(audit, out.request_id)
    assert sum("kept" in r for r in recs) >= 4
    plen = len(out.prompt_token_ids)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    deaths = deaths_from_rounds(recs, 4, 2, len(ids), 16)
    with torch.no_grad():
        under = deathtime_model(input_ids=torch.tensor([ids]), kvtier_deaths=deaths.unsqueeze(0)).logits[0]
        plain = deathtime_model(input_ids=torch.tensor([ids])).logits[0]
    eng = engine_logprobs(out)
    assert (eng - _token_logprobs(under, ids, plen)).abs().max() < 0.06
    assert (eng - _token_logprobs(plain, ids, plen)).abs().max() > 0.3


@pytest.mark.engine
def test_random_deaths_rederived_from_the_seed_equal_the_engines_audit_log(engine_batch):
    """What the RL learner relies on: for `random` the record is a function of the request's seed and
    schedule, so re-deriving it gives exactly the engine's logged keep-sets."""
    from engine_helpers import records_for

    outs, audit = engine_batch
    out = outs["random"]
    n = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
    spec = EvictionSpec(policy="random", budget=48, buffer=16, seed=11)
    logged = deaths_from_rounds(records_for(audit, out.request_id), 4, 2, n, 16)
    derived = simulate_deaths(spec.make_policy(), spec.schedule(), len(out.prompt_token_ids), n, num_layers=4,
                              num_kv_heads=2, seed=11)
    assert (logged != NEVER).sum() > 0
    assert torch.equal(derived, logged)


def test_gpu_check_runs_on_a_bare_torch_machine(tmp_path):
    """`PYTHONPATH=src python -m kvtier.benchmarks.gpu_deathtime` as a lent GPU (no vLLM, pydantic, typer or
    Ray) would run it, here on CPU at a small size: the flex and mask paths agree."""
    import json

    from bare_torch import run_on_bare_torch

    out = tmp_path / "d.json"
    proc = run_on_bare_torch("kvtier.benchmarks.gpu_deathtime", [
        "--device", "cpu", "--length", "160", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--budget", "48",
        "--buffer", "8", "--dtype", "float32", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["max_abs_diff"]["out"] < 1e-4 and 0.3 < r["evicted_share"] < 0.9
