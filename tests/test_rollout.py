"""kvtier's verl 0.9.1 rollout backend on CPU, through verl's own Ray path.

One local Ray cluster and ONE compressed engine for the whole module: verl's `LLMServerManager` builds
the `kvtier` replica through `RolloutReplicaRegistry` (rollout.name=kvtier), the replica launches a
`KVTierServer` actor (vLLM 0.31 AsyncLLM + kvtier eviction), and verl's `AgentLoopManager` runs the
single-turn agent loop against it: DataProto in, DataProto out. A stock vLLM reference (kvtier plugin
not loaded; the server's own engine arguments and thread count) runs in a subprocess before the kvtier
engine starts (Ray comes up meanwhile), so only one engine is alive at a time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from engine_helpers import records_for  # noqa: E402

pytestmark = pytest.mark.engine

BUDGET, BUFFER = 64, 16
PROMPT_LEN, RESPONSE_LEN = 64, 160
GREEDY_TOKENS = 80
TEST_TOOL_PARSER = "kvtier_test_always_call"
_rng = random.Random(6)
# token-id prompts (the tiny vocabulary's ordinary tokens start after the 3 specials)
ID_PROMPTS = [[_rng.randrange(3, 3000) for _ in range(n)] for n in (24, 41, 57)]
CHAT_PROMPTS = [
    "Let x = 42. What is x times seven? Think step by step.",
    "A train leaves at noon at sixty miles per hour; another leaves an hour later at eighty. When do they meet?",
    "Prove that the sum of two even numbers is even.",
    "Count from one to ten.",
]


# -- fixtures -------------------------------------------------------------------------------------
def _server_engine(config) -> tuple[dict, str]:
    """(vLLM engine arguments, OMP_NUM_THREADS) of the rollout server's engine for `config`.

    The arguments are the ones the server builds (`KVTierServer.engine_args`; the replica's only server,
    rank 0) minus what is kvtier's own: `additional_config` (the eviction plugin's settings) and the
    worker extension (weight sync). The thread count matters as much: on CPU the GEMM kernels' reduction
    order depends on it, and with random weights exact and near ties in the bf16 logits are common, so
    1 vs 2 threads flips greedy tokens. The server is a Ray actor reserving `server_num_cpus` CPUs (0 by
    default, see `KVTierReplica.launch_servers`), for which Ray sets OMP_NUM_THREADS to
    max(1, floor(num_cpus)) unless the environment sets it; its engine-core process inherits that, and
    vLLM's CPU worker keeps torch at that many threads. The test checks the actor's value."""
    import math

    from kvtier.rollout.server import KVTierServer

    saved = os.environ.get("VERL_REPLICA_RANK")  # KVTierServer.__init__ sets it for its own process
    try:
        server = KVTierServer(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, replica_rank=0)
        kwargs = server.engine_args()
    finally:
        if saved is None:
            os.environ.pop("VERL_REPLICA_RANK", None)
        else:
            os.environ["VERL_REPLICA_RANK"] = saved
    kwargs.pop("additional_config")
    kwargs.pop("worker_extension_cls", None)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, math.floor(server.settings.server_num_cpus or 0)))
    return kwargs, threads


def _stock_vllm_process(engine_kwargs: dict, omp_threads: str) -> subprocess.Popen:
    """Greedy continuations (and top-2 log-probs per step) from stock vLLM (VLLM_PLUGINS=none: kvtier not
    loaded) with the rollout server's engine arguments and thread count, one request at a time after
    the same warm-up request the server makes."""
    from kvtier.engine.api import WARMUP_PROMPT_TOKENS

    script = (
        "import json, sys\nfrom vllm import LLM, SamplingParams\n"
        "kw, prompts, n, warm = json.loads(sys.argv[1])\n"
        "llm = LLM(**kw)\n"
        "llm.generate([{'prompt_token_ids': list(range(10, 10 + warm))}], SamplingParams(max_tokens=2, temperature=0),"
        " use_tqdm=False)\n"
        "sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)\n"
        "out = []\n"
        "for p in prompts:\n"
        "    c = llm.generate([{'prompt_token_ids': p}], sp, use_tqdm=False)[0].outputs[0]\n"
        "    top2 = [sorted((v.logprob for v in lp.values()), reverse=True)[:2] for lp in c.logprobs]\n"
        "    out.append({'token_ids': list(c.token_ids), 'top2': top2})\n"
        "print('RESULT' + json.dumps(out))\n")
    arg = json.dumps([engine_kwargs, ID_PROMPTS, GREEDY_TOKENS, WARMUP_PROMPT_TOKENS])
    env = {**os.environ, "VLLM_PLUGINS": "none", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": omp_threads}
    return subprocess.Popen([sys.executable, "-c", script, arg], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _start_prometheus(tmp_path_factory):
    """Debian's Prometheus scraping this module's Ray (the rollout dashboard's live check), if installed."""
    from kvtier.observability.prometheus import LocalPrometheus, binary
    from service_helpers import free_port

    if binary() is None:
        return None
    os.environ["RAY_metrics_report_interval_ms"] = "1000"   # Ray's exporter push period (10 s by default)
    metrics_port = free_port()
    prom = LocalPrometheus([f"127.0.0.1:{metrics_port}"], free_port(), scrape_interval_s=1,
                           data_dir=tmp_path_factory.mktemp("rollout_prom"))
    prom.metrics_port = metrics_port
    prom.wait_ready()
    return prom


@pytest.fixture(scope="module")
def rollout(tiny_model_dir, tmp_path_factory):
    """The stock reference runs first (its engine is gone before kvtier's starts); Ray starts meanwhile."""
    from kvtier.rollout.cpu.local import LocalRollout, init_local_ray
    from kvtier.rollout.verl_config import compose_config, cpu_rollout_overrides

    t0 = time.perf_counter()
    audit = str(tmp_path_factory.mktemp("rollout_audit") / "keep.jsonl")
    config = compose_config(cpu_rollout_overrides(
        tiny_model_dir, budget=BUDGET, buffer=BUFFER, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
        kv_cache_bytes=32 << 20, audit_log=audit, seed=0, max_model_len=2048, protect="first_turn")
        # seeded sampling (verl's full_determinism): the same batches every run, so the statistical
        # checks (tolerances, lengths with sampled EOS) cannot fail by chance on one run in many
        + ["actor_rollout_ref.rollout.full_determinism=true",
           # verl's tool agent loop (test_tool_agent_loop_...): a test tool parser, a few turns
           f"actor_rollout_ref.rollout.multi_turn.format={TEST_TOOL_PARSER}",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=6"])
    engine_kwargs, omp_threads = _server_engine(config)
    stock = _stock_vllm_process(engine_kwargs, omp_threads)
    try:
        if ray.is_initialized():  # a leftover from an earlier module; this module needs its runtime env
            ray.shutdown()
        prom = _start_prometheus(tmp_path_factory)
        started = init_local_ray(num_cpus=2, metrics_export_port=prom.metrics_port if prom else None)
        t_ray = time.perf_counter()
        out, err = stock.communicate(timeout=600)
    finally:
        if stock.poll() is None:
            stock.kill()
            stock.wait()
    line = next((l for l in out.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, err[-3000:]
    t_stock = time.perf_counter()
    local = None
    try:
        local = LocalRollout(config)
        local.audit_log = audit
        local.stock_greedy = json.loads(line[len("RESULT"):])
        local.stock_omp_threads = omp_threads
        local.prometheus = prom
        print(f"\n[test_rollout] ray {t_ray - t0:.1f}s, stock vLLM reference done at {t_stock - t0:.1f}s, "
              f"verl servers + agent loop at {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        yield local
    finally:
        if local is not None:
            local.close()
        if started:
            ray.shutdown()
        if prom is not None:
            prom.stop()


def generate(rollout, prompt_ids, **sampling):
    return ray.get(rollout.server.generate.remote(prompt_ids=prompt_ids, sampling_params=sampling,
                                                  request_id=f"t{random.getrandbits(48):x}"))


def unpadded(out, i):
    """(prompt ids, response ids) of sample i of verl's padded output batch."""
    b = out.batch
    plen = b["prompts"].shape[1]
    prompt = b["prompts"][i][b["attention_mask"][i, :plen].bool()].tolist()
    n = int(b["response_mask"][i].sum())
    return prompt, b["responses"][i, :n].tolist()


# -- tests ----------------------------------------------------------------------------------------
def test_rollout_config_to_engine_arguments_and_request_overrides(tiny_model_dir):
    """No engine: rollout.custom.kvtier / engine_kwargs.kvtier -> vLLM engine arguments; kvtier_* keys in
    verl's sampling params -> SamplingParams.extra_args; typos are errors."""
    from types import SimpleNamespace

    from verl.utils.config import omega_conf_to_dataclass

    from kvtier.engine.config import EvictionConfigError
    from kvtier.rollout.settings import KVTierRolloutSettings, engine_args_from_rollout, split_request_params
    from kvtier.rollout.verl_config import compose_config, cpu_rollout_overrides

    cfg = compose_config(cpu_rollout_overrides(tiny_model_dir, budget=128, buffer=32, policy="recency")
                         + ["++actor_rollout_ref.rollout.engine_kwargs.kvtier.max_num_seqs=3",
                            "actor_rollout_ref.rollout.enable_prefix_caching=true"])
    rc = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    settings = KVTierRolloutSettings.from_rollout_config(rc)
    assert settings.eviction.default.budget == 128 and settings.eviction.default.policy == "recency"
    args = engine_args_from_rollout(rc, SimpleNamespace(local_path=tiny_model_dir, trust_remote_code=False),
                                    settings, seed=0, sleep_supported=False)
    assert args["model"] == tiny_model_dir and args["enable_prefix_caching"] is True
    assert args["additional_config"]["kvtier"]["default"]["budget"] == 128
    assert args["kv_cache_memory_bytes"] == 64 << 20 and args["max_num_seqs"] == 3
    assert args["worker_extension_cls"] == "kvtier.rollout.worker_ext.KVTierWorkerExtension"
    assert args["enable_sleep_mode"] is False and args["distributed_executor_backend"] == "uni"

    sp, extra = split_request_params({"temperature": 0, "kvtier_budget": None, "kvtier_policy": "random"})
    assert sp == {"temperature": 0} and extra == {"kvtier_budget": "full", "kvtier_policy": "random"}
    with pytest.raises(EvictionConfigError, match="unknown kvtier request parameter"):
        split_request_params({"kvtier_bugdet": 64})
    with pytest.raises(EvictionConfigError, match="unknown key"):
        KVTierRolloutSettings.from_custom({"kvtier": {"budegt": 64}})
    # protect / val_budget: defaults are the paper's rule and full-attention validation
    assert (settings.protect, settings.val_budget) == ("all", "full")
    assert settings.validation_request_args() == {"kvtier_budget": "full"}
    s2 = KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "protect": "first_turn", "val_budget": 256}})
    assert (s2.protect, s2.validation_request_args()) == ("first_turn", {"kvtier_budget": 256})
    s3 = KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "protect": 32, "val_budget": "train"}})
    assert (s3.protect, s3.validation_request_args()) == (32, {})
    for bad in ({"protect": "last_turn"}, {"val_budget": 0}, {"val_budget": "half"}):
        with pytest.raises(EvictionConfigError, match="protect|val_budget"):
            KVTierRolloutSettings.from_custom({"kvtier": bad})


def test_backend_selected_by_rollout_name_and_registered_in_ray_workers(rollout):
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from kvtier.rollout.adapter import KVTierServerAdapter
    from kvtier.rollout.cpu.local import registration_state
    from kvtier.rollout.replica import KVTierReplica

    cfg = rollout.config
    assert cfg.actor_rollout_ref.rollout.name == "kvtier"
    assert get_rollout_replica_class("kvtier") is KVTierReplica
    assert get_rollout_class("kvtier", "async") is KVTierServerAdapter
    assert all(isinstance(r, KVTierReplica) for r in rollout.replicas)
    # A Ray worker that never imported kvtier (verl's agent-loop worker) got the registration from
    # VERL_USE_EXTERNAL_MODULES through verl's own __init__.
    worker = rollout.agent.agent_loop_workers[0]
    state = ray.get(worker.__ray_call__.remote(registration_state))
    assert state == {"plugin_imported": True, "replica": True, "adapter": True}, state
    # The config that ships turns on rollout log-probs and token-level truncated IS.
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    rc = cfg.algorithm.rollout_correction
    assert rc.rollout_is == "token" and float(rc.rollout_is_threshold) == 2.0 and rc.bypass_mode is False


def test_agent_loop_batch_responses_logprobs_and_eviction_stats(rollout, replay):
    """DataProto through verl's agent loop: responses, a log-prob per response token that equals a
    masked-attention replay of the engine's logged keep-sets, and per-sample eviction columns."""
    from kvtier.deathtime import deaths_from_rounds, simulate_deaths
    from kvtier.policies import EvictionSchedule, make_policy
    from kvtier.rollout.cpu.local import chat_batch
    from kvtier.rollout.metrics import eviction_metrics

    out = rollout.generate_sequences(chat_batch(CHAT_PROMPTS))
    b, nt = out.batch, out.non_tensor_batch
    n = len(CHAT_PROMPTS)
    assert b["responses"].shape == (n, RESPONSE_LEN)
    assert b["rollout_log_probs"].shape == b["responses"].shape
    block_size = ray.get(rollout.server.engine_info.remote())["block_size"]
    lengths = []
    for i in range(n):
        prompt, response = unpadded(out, i)
        total = len(prompt) + len(response)
        lengths.append(total)
        # sampling may stop at an EOS (rare with the tiny model); otherwise exactly response_length tokens
        assert 0 < len(response) <= RESPONSE_LEN
        assert len(response) == RESPONSE_LEN or response[-1] in (0, 2)
        # one log-prob per response token, zeros on the padding
        lp = b["rollout_log_probs"][i]
        assert torch.isfinite(lp).all() and (lp[: len(response)] < 0).all() and (lp[len(response):] == 0).all()
        assert nt["kvtier_budget"][i] == BUDGET and nt["kvtier_preemptions"][i] == 0
        assert nt["kvtier_generate_calls"][i] == 1
        assert (nt["kvtier_buffer"][i], nt["kvtier_policy"][i]) == (BUFFER, "random") and nt["kvtier_seed"][i] is not None
        events, evicted = nt["kvtier_eviction_events"][i], nt["kvtier_tokens_evicted"][i]
        if total > BUDGET + 2 * BUFFER:      # long sample: rounds ran, tokens were evicted
            assert events > 0 and evicted > 0
            # each round cuts every head back to K + r entries: evicted <= (length at last round) - (K + r)
            assert evicted <= total - (BUDGET + BUFFER)
        elif total <= BUDGET + BUFFER:       # never exceeded K + r: nothing to evict
            assert events == 0 and evicted == 0
        # the cache stayed bounded by max(prompt, K + 2r) entries
        bound = -(-max(len(prompt), BUDGET + 2 * BUFFER) // block_size)
        assert 0 < nt["kvtier_peak_kv_blocks"][i] <= bound
    assert max(lengths) > BUDGET + 2 * BUFFER
    metrics = eviction_metrics(out)
    assert metrics["rollout/kvtier/compressed_fraction"] == 1.0
    assert metrics["rollout/kvtier/eviction_events/mean"] > 0
    assert out.meta_info["timing"]["agent_loop/num_preempted/max"] == 0

    # The returned log-probs are the engine's sampling log-probs under eviction (temperature 1, no top-k/p:
    # processed log-probs equal the model's): replay the two longest samples that had eviction rounds.
    # (samples stop at a sampled EOS now and then, so pick among those that had rounds)
    evicted = [j for j in range(n) if nt["kvtier_eviction_events"][j] > 0]
    assert evicted
    for i in sorted(evicted, key=lambda j: -lengths[j])[:2]:
        prompt, response = unpadded(out, i)
        recs = records_for(rollout.audit_log, nt["kvtier_request_id"][i])
        assert len([r for r in recs if "kept" in r]) == nt["kvtier_eviction_events"][i] > 0
        # #24 item 2: the learner re-derives the sample's evictions from the returned seed, buffer and policy
        total = len(prompt) + len(response)
        derived = simulate_deaths(make_policy(nt["kvtier_policy"][i]), EvictionSchedule(BUDGET, nt["kvtier_buffer"][i]),
                                  len(prompt), total, num_layers=4, num_kv_heads=2, seed=int(nt["kvtier_seed"][i]))
        assert torch.equal(derived, deaths_from_rounds(recs, 4, 2, total, BUFFER))
        ref = replay.logprobs(prompt + response, len(prompt), recs, BUFFER)
        eng = b["rollout_log_probs"][i, : len(response)]
        err = (eng - ref).abs().max()
        assert err < 0.06, f"sample {i}: max |returned - masked reference| = {err:.4f}"
        control = (eng - replay.logprobs(prompt + response, len(prompt), [], BUFFER)).abs().max()
        assert control > 0.3, "eviction did not change attention; the comparison proves nothing"


def test_learner_replay_scores_the_agent_loop_batch_as_the_engine_did(rollout, replay):
    """#24 item 3 on one batch: verl's conversion (DataProto -> no-padding TensorDict, as its trainer hands a
    batch to the actor), the replay engine's death tensor (`learner_replay.micro_batch_deaths`, re-derived from
    the returned seed) and one padded forward of the transformers model: every sampled token's log-prob equals
    the rollout's (bf16 engine vs fp32: < 0.06); the dense learner's (no deaths) does not (> 0.3)."""
    from verl.workers.utils.padding import build_attention_mask_from_nested, left_right_2_no_padding

    from kvtier.rollout.cpu.local import chat_batch
    from kvtier.rollout.learner_replay import micro_batch_deaths

    out = rollout.generate_sequences(chat_batch(CHAT_PROMPTS))
    td = left_right_2_no_padding(out.to_tensordict())
    lengths = td["input_ids"].offsets().diff().tolist()
    n, width = len(lengths), max(lengths)
    deaths, counts = micro_batch_deaths(td, width, packed=False, num_layers=4, num_kv_heads=2)
    assert counts["replayed"] == n
    ids = torch.nested.to_padded_tensor(td["input_ids"], 0, output_size=(n, width))
    mask = build_attention_mask_from_nested(input_ids=td["input_ids"], max_seq_len=width)
    with torch.no_grad():
        logp = {name: torch.log_softmax(replay.model(input_ids=ids, attention_mask=mask, **kw).logits.float(), -1)
                for name, kw in (("replay", {"kvtier_deaths": deaths}), ("dense", {}))}
    for i in range(n):
        prompt, response = unpadded(out, i)
        p, total = len(prompt), len(prompt) + len(response)
        assert total == lengths[i]
        eng = out.batch["rollout_log_probs"][i, : len(response)]
        tok = ids[i, p:total].unsqueeze(1)
        got = {k: v[i, p - 1 : total - 1].gather(1, tok).squeeze(1) for k, v in logp.items()}
        assert (got["replay"] - eng).abs().max() < 0.06, f"sample {i}: replay learner vs rollout"
        assert (got["dense"] - eng).abs().max() > 0.3, f"sample {i}: the dense learner agrees: no eviction?"


def test_budget_at_least_length_matches_plain_vllm_token_for_token(rollout):
    """Through the server's verl `generate`: K >= length (no round can run) and full attention both give
    stock vLLM's greedy tokens; a sample shorter than K + r under the default budget is never evicted.

    Exact identity is the claim: the reference runs the same vLLM engine arguments and OMP thread count
    as the server (`_server_engine`) and one request at a time, as here, so both run the same kernels on
    the same shapes and a plugin that stays out of the way yields bit-identical logits, ties included
    (the tiny random model has exact bf16 ties; a different thread count alone flips one at step 75 of
    the second prompt on AVX-512 machines)."""
    # (a lambda: cloudpickle ships it by value; the actor cannot import this test module)
    server_threads = ray.get(rollout.server.__ray_call__.remote(lambda _self: os.environ.get("OMP_NUM_THREADS")))
    assert server_threads == rollout.stock_omp_threads, (
        f"the server's engine runs with OMP_NUM_THREADS={server_threads}, the stock reference ran with "
        f"{rollout.stock_omp_threads}: fix _server_engine")
    for prompt, ref in zip(ID_PROMPTS, rollout.stock_greedy):
        stock = ref["token_ids"]
        big = generate(rollout, prompt, temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=True,
                       kvtier_budget=4096)
        assert big.token_ids == stock, _divergence(big.token_ids, ref)
        assert big.stop_reason == "completed" and len(big.log_probs) == GREEDY_TOKENS
        assert big.extra_fields["kvtier_budget"] == 4096 and big.extra_fields["kvtier_eviction_events"] == 0
        full = generate(rollout, prompt, temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                        kvtier_budget=None)
        assert full.token_ids == stock, _divergence(full.token_ids, ref)
        assert full.extra_fields["kvtier_budget"] is None and full.num_preempted is None
    short = generate(rollout, ID_PROMPTS[0], temperature=0, max_tokens=BUDGET + BUFFER - len(ID_PROMPTS[0]))
    assert short.extra_fields["kvtier_budget"] == BUDGET
    assert short.extra_fields["kvtier_eviction_events"] == 0 and short.extra_fields["kvtier_tokens_evicted"] == 0


def _divergence(tokens: list[int], ref: dict) -> str:
    i = next((j for j, (a, b) in enumerate(zip(tokens, ref["token_ids"])) if a != b), None)
    if i is None:
        return f"lengths differ: {len(tokens)} vs stock {len(ref['token_ids'])}"
    top2 = ref["top2"][i]
    return f"first difference at {i}: {tokens[i]} vs stock {ref['token_ids'][i]}, stock top-2 log-probs {top2}"


def test_sleep_wake_abort_resume_keep_serving(rollout):
    """Replica-level controls verl calls: sleep/wake (no-ops on CPU: vLLM has no sleep mode there),
    abort_all_requests (partial rollout / weight sync) and resume_generation."""
    replica = rollout.replicas[0]
    asyncio.run(replica.sleep())
    asyncio.run(replica.wake_up())
    long_tokens = 1800
    pending = rollout.server.generate.remote(prompt_ids=ID_PROMPTS[1], sampling_params={"max_tokens": long_tokens,
                                             "ignore_eos": True}, request_id="long-abort")
    deadline = time.monotonic() + 120
    while ray.get(rollout.server.num_unfinished_requests.remote()) == 0:
        assert time.monotonic() < deadline, "the long request never reached the engine"
        time.sleep(0.05)
    time.sleep(0.5)
    try:
        result = asyncio.run(replica.abort_all_requests())
        assert result["aborted_count"] >= 1
        out = ray.get(pending, timeout=120)
        assert out.stop_reason == "aborted" and len(out.token_ids) < long_tokens
    finally:
        asyncio.run(replica.resume_generation())
    again = generate(rollout, ID_PROMPTS[0], temperature=0, max_tokens=8)
    assert len(again.token_ids) == 8 and again.stop_reason == "completed"


def _perturbed_state_dict(model, seed: int) -> dict[str, torch.Tensor]:
    """New weights for the same architecture, rounded to bf16 so the engine holds exactly these values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        t = p.detach().clone().float()
        if t.dim() == 2:
            live = (t != 0).any(dim=1, keepdim=True)  # keep the zeroed special-token rows of lm_head zero
            t = t + torch.randn(t.shape, generator=g) * t.std() * live
        out[name] = t.to(torch.bfloat16).float()
    return out


def _ref_logprobs(model, ids: list[int], prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    rows = lp[prompt_len - 1 : len(ids) - 1]
    return rows.gather(1, torch.tensor(ids[prompt_len:]).unsqueeze(1)).squeeze(1), rows.max(dim=1).values


def test_weight_update_from_trainer_changes_outputs_to_the_new_weights(rollout, tiny_model_dir):
    """verl's worker-side adapter (get_rollout_class('kvtier')) pushes a state dict; the running engine then
    decodes as transformers does with the same weights (teacher-forced log-probs within bf16 noise, every
    greedy token an argmax of the reference), and clearly not as the old weights."""
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.base import get_rollout_class

    old_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new_sd = _perturbed_state_dict(old_model, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_sd)

    cfg = rollout.config.actor_rollout_ref
    adapter = get_rollout_class(cfg.rollout.name, cfg.rollout.mode)(config=cfg.rollout, model_config=cfg.model,
                                                                   device_mesh=None)
    adapter.bucket_bytes = 4 << 20  # several buckets: layers straddle bucket boundaries
    prompt = ID_PROMPTS[2]
    n = 24
    before = generate(rollout, prompt, temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, kvtier_budget=None)

    report = asyncio.run(adapter.update_weights(iter(new_sd.items()), global_steps=3))
    assert report["missing"] == [], report
    after = generate(rollout, prompt, temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, kvtier_budget=None)
    assert after.extra_fields["global_steps"] == 3
    ids = prompt + after.token_ids
    ref_lp, ref_max = _ref_logprobs(new_model, ids, len(prompt))
    eng = torch.tensor(after.log_probs)
    assert (eng - ref_lp).abs().max() < 0.06, (eng - ref_lp).abs().max()
    assert (ref_lp >= ref_max - 0.06).all(), "a greedy token is not an argmax under the new weights"
    old_lp, _ = _ref_logprobs(old_model, ids, len(prompt))
    assert (eng - old_lp).abs().max() > 0.3, "outputs still follow the old weights"
    assert after.token_ids != before.token_ids

    # and back: the original weights give the original tokens again
    asyncio.run(adapter.update_weights(iter(old_model.state_dict().items()), global_steps=4))
    restored = generate(rollout, prompt, temperature=0, max_tokens=n, ignore_eos=True, kvtier_budget=None)
    assert restored.token_ids == before.token_ids


def test_rollout_dashboard_reads_the_samples_from_a_live_prometheus(rollout):
    """Prometheus scrapes the rollout servers' Ray metrics: a batch moves the token counter by its response
    tokens and each histogram by one observation per sample; every rollout-dashboard query returns data."""
    from prom_helpers import empty_panel_queries, ray_histogram_sum, settled, wait_deltas

    from kvtier.observability import dashboards
    from kvtier.observability.exporters import EVICTIONS_BOUNDARIES, RESPONSE_LENGTH_BOUNDARIES
    from kvtier.rollout.cpu.local import chat_batch

    prom = rollout.prometheus
    if prom is None:
        pytest.skip("Debian's prometheus is not installed (make system-deps)")
    tokens, lengths = "sum(ray_kvtier_rollout_generation_tokens_total)", "ray_kvtier_rollout_response_length_tokens"
    evictions = "ray_kvtier_rollout_evictions_per_sample"
    before = settled(prom, [tokens, f"sum({lengths}_count)", f"sum({lengths}_sum)", f"sum({evictions}_count)",
                            f"sum({evictions}_sum)"])
    out = rollout.generate_sequences(chat_batch(CHAT_PROMPTS))
    n = len(CHAT_PROMPTS)
    generated = int(out.batch["response_mask"].sum())
    per_sample = [int(x) for x in out.non_tensor_batch["kvtier_eviction_events"]]
    assert sum(per_sample) > 0
    # Ray exports a histogram's _sum from bucket midpoints (see kvtier.observability.catalog)
    lens = out.batch["response_mask"].sum(-1).tolist()
    expected = {tokens: generated, f"sum({lengths}_count)": n,
                f"sum({lengths}_sum)": ray_histogram_sum(lens, RESPONSE_LENGTH_BOUNDARIES),
                f"sum({evictions}_count)": n, f"sum({evictions}_sum)": ray_histogram_sum(per_sample, EVICTIONS_BOUNDARIES)}
    wait_deltas(prom, before, expected)
    # the "Learner vs sampler" row: what a v1 kvtier_<mode> trainer exports once per step (no trainer runs
    # here); a class defined in the test is shipped to the actor by value
    class LearnerStep:
        def step(self):
            from kvtier.observability.exporters import LearnerMetricsExporter
            from kvtier.rollout.trainer_hooks import export_learner_metrics

            self.exporter = LearnerMetricsExporter("replay")
            export_learner_metrics(self.exporter, {
                "rollout/kvtier/mismatch/kl": 1e-5, "rollout/kvtier/mismatch/max_abs_log_ratio": 0.2,
                "rollout/kvtier/mismatch/token_ratio_min": 0.8, "rollout/kvtier/mismatch/token_ratio_p01": 0.997,
                "rollout/kvtier/mismatch/share_below_0_86": 1e-4, "rollout/kvtier/replayable/replayed": 8.0})

    trainer = ray.remote(num_cpus=0)(LearnerStep).remote()
    ray.get(trainer.step.remote())
    queries = dashboards.panel_queries(dashboards.to_dict(dashboards.rollout()))
    assert len(queries) >= 10
    assert not (empty := empty_panel_queries(prom, queries)), empty


# -- multi-turn beyond K, validation budget, metrics, sleep drain, counters, /dev/shm -------------------
def _turns(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s (an assistant turn) in a response mask."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_tool_agent_loop_multi_turn_beyond_budget_runs_compressed(rollout, replay):
    """verl's ToolAgentLoop resends the whole history each turn; with `protect: first_turn` the server
    protects only the first prompt, so turns whose context exceeds K run compressed (with the paper's rule
    they would be rejected: the budget cannot hold the protected prompt). Every round of a later turn keeps
    the first prompt in every head, and the log-probs of a long later turn match the masked reference.
    Each sample's kvtier counters cover all of its turns (verl keeps only the first turn's extra_fields;
    kvtier's agent-loop worker adds the calls up)."""
    import numpy as np

    from kvtier.rollout.cpu.local import chat_batch

    def register_parser(_worker, name=TEST_TOOL_PARSER):
        """In an agent-loop worker (a nested function: cloudpickle ships it by value): a tool parser that
        calls a tool after every assistant turn and ends a turn at one of ~1 in 60 token ids (the tiny
        model samples almost uniformly), so verl's ToolAgentLoop runs several short turns, resending the
        growing history each time. The tool is not registered: verl answers with a tool message
        ("Unknown function ...") and the conversation goes on."""
        from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

        class AlwaysCall(ToolParser):
            @property
            def stop_token_ids(self):
                return list(range(3, 4096, 60))

            async def extract_tool_calls(self, responses_ids, tools=None):
                return self.tokenizer.decode(responses_ids), [FunctionCall(name="lookup", arguments="{}")]

        ToolParser._registry[name] = AlwaysCall
        return True

    for w in rollout.agent.agent_loop_workers:
        assert ray.get(w.__ray_call__.remote(register_parser))
        assert ray.get(w.__ray_call__.remote(_call_recorder()[0]))
    n = 4
    batch = chat_batch([f"Look up the population of city number {i} and report it." for i in range(n)])
    batch.non_tensor_batch["agent_name"] = np.array(["tool_agent"] * n, dtype=object)
    batch.non_tensor_batch["priority"] = np.arange(91000, 91000 + n)        # request ids det-91000...: unique here
    out = rollout.generate_sequences(batch)
    b, nt = out.batch, out.non_tensor_batch
    assert max(nt["__num_turns__"]) >= 4, nt["__num_turns__"]
    _check_sample_counters_cover_every_turn(rollout, out, n)
    checked_rounds, long_turns = 0, []
    for i in range(n):
        prompt, _ = unpadded(out, i)
        plen = len(prompt)
        mask = b["response_mask"][i].tolist()
        turns = _turns(mask)
        recs = [r for r in records_for(rollout.audit_log, f"det-{91000 + i}") if "kept" in r]
        by_turn = {}
        for r in recs:
            by_turn.setdefault(r["req_id"], []).append(r)
        for start, end in turns[1:]:
            ctx = plen + start                                 # the turn's prompt: first prompt + history
            if ctx <= BUDGET:
                continue
            turn_recs = [rs for rs in by_turn.values() if rs[0]["prompt_len"] == ctx]
            assert len(turn_recs) == 1, f"sample {i}: no rounds for the turn with a {ctx}-token context"
            rounds = turn_recs[0]
            for r in rounds:
                assert r["protected"] == plen, (r["protected"], plen)
                kept = torch.tensor(r["kept"])
                assert (kept[..., :plen] == torch.arange(plen)).all(), "the first turn was evicted"
            checked_rounds += len(rounds)
            long_turns.append((end - start, i, start, end, rounds))
    assert checked_rounds > 0, "no turn beyond K ran an eviction round"
    # the later turn with the most rounds: the engine's log-probs equal the masked replay of its own rounds
    _, i, start, end, rounds = max(long_turns, key=lambda t: (len(t[4]), t[0]))
    prompt, _ = unpadded(out, i)
    ids = prompt + b["responses"][i, :end].tolist()
    ref = replay.logprobs(ids, len(prompt) + start, rounds, BUFFER)
    eng = b["rollout_log_probs"][i, start:end]
    err = (eng - ref).abs().max()
    assert err < 0.06, f"sample {i} turn [{start}, {end}): max |engine - masked reference| = {err:.4f}"
    control = (eng - replay.logprobs(ids, len(prompt) + start, [], BUFFER)).abs().max()
    assert control > 0.3, "eviction did not change attention; the comparison proves nothing"
    print(f"\n[tool agent] turns per sample {list(nt['__num_turns__'])}, {len(long_turns)} later turns beyond K, "
          f"{checked_rounds} rounds checked; replayed sample {i} turn [{start}, {end}) after a "
          f"{len(prompt) + start}-token context: max err {err:.4f}, unmasked {control:.4f}", file=sys.stderr)


def _call_recorder():
    """(install, collect) for `__ray_call__` on an agent-loop worker (nested functions: cloudpickle ships them
    by value; the actor cannot import this test module). install: from now on keep every server call's kvtier
    fields with the trajectory's `SampleCounters` they were added to (kept alive, so ids stay unique)."""

    def install(_worker):
        from kvtier.rollout import sample_counters as sc

        if not hasattr(sc, "_test_calls"):
            sc._test_calls = []
            add = sc.SampleCounters.add

            def recording_add(self, extra, *args, **kwargs):
                if extra and "kvtier_budget" in extra:
                    sc._test_calls.append((self, {k: v for k, v in extra.items() if k.startswith("kvtier_")}))
                return add(self, extra, *args, **kwargs)

            sc.SampleCounters.add = recording_add
        sc._test_calls.clear()
        return True

    def collect(_worker):
        from kvtier.rollout import sample_counters as sc

        return [(id(counters), extra) for counters, extra in getattr(sc, "_test_calls", [])]

    return install, collect


def _check_sample_counters_cover_every_turn(rollout, out, n):
    """Each sample's kvtier columns are the totals over all of its generate calls (one per assistant turn):
    against the server's per-call fields recorded in the agent-loop workers, and the events against the
    engine's audit log (one record per eviction round, over every turn's vLLM request of the sample)."""
    from kvtier.rollout.replay_status import FIELDS as REPLAY_FIELDS
    from kvtier.rollout.replay_status import by_segment

    nt = out.non_tensor_batch
    groups: dict[tuple, list[dict]] = {}
    for w, worker in enumerate(rollout.agent.agent_loop_workers):
        for key, extra in ray.get(worker.__ray_call__.remote(_call_recorder()[1])):
            groups.setdefault((w, key), []).append(extra)
    more_than_first = 0
    for i in range(n):
        calls = [g for g in groups.values() if g[0]["kvtier_request_id"] == nt["kvtier_request_id"][i]]
        assert len(calls) == 1, f"sample {i}: its server calls were not recorded"
        calls = calls[0]
        # one call per assistant turn (a first turn that fills response_length is the only one)
        assert nt["kvtier_generate_calls"][i] == len(calls), (i, len(calls), nt["__num_turns__"][i])
        for key in ("kvtier_eviction_events", "kvtier_tokens_evicted", "kvtier_preemptions"):
            assert nt[key][i] == sum(c[key] for c in calls), (i, key, nt[key][i], [c[key] for c in calls])
        assert nt["kvtier_peak_kv_blocks"][i] == max(c["kvtier_peak_kv_blocks"] for c in calls)
        assert nt["kvtier_budget"][i] == BUDGET
        rounds = [r for r in records_for(rollout.audit_log, f"det-{91000 + i}") if "kept" in r]
        assert len(rounds) == nt["kvtier_eviction_events"][i], (i, len(rounds), nt["kvtier_eviction_events"][i])
        assert len({r["req_id"] for r in rounds}) <= len(calls)
        more_than_first += nt["kvtier_eviction_events"][i] > calls[0]["kvtier_eviction_events"]
        # every call's segments travel with the sample: the learner replays it by segment (#60 item 3)
        fields = {k: nt[k][i] if k in nt else None for k in REPLAY_FIELDS}
        assert len(calls) < 2 or by_segment(fields), (i, fields)
    assert max(nt["kvtier_generate_calls"]) >= 2
    assert more_than_first > 0, "no sample had eviction rounds after its first turn"
    # and the trainer's metrics reduce the totals (KVTierAgentLoopManager put them into the batch's timing)
    from kvtier.rollout.metrics import eviction_metrics

    metrics = eviction_metrics(out)
    assert out.meta_info["timing"]["rollout/kvtier/eviction_events/mean"] == metrics[
        "rollout/kvtier/eviction_events/mean"] == pytest.approx(sum(nt["kvtier_eviction_events"]) / n)
    assert metrics["rollout/kvtier/generate_calls/max"] == max(nt["kvtier_generate_calls"])
    print(f"\n[tool agent] generate calls per sample {list(nt['kvtier_generate_calls'])}, eviction events "
          f"{list(nt['kvtier_eviction_events'])}", file=sys.stderr)


def test_validation_runs_at_val_budget_and_metrics_reach_the_trainer(rollout):
    """Validation batches (meta_info validate=True, as verl's trainers send them) run at
    `val_budget` (default: full attention) through kvtier's agent-loop manager; training batches carry
    their eviction metrics into meta_info["timing"], which verl's RayPPOTrainer turns into logged
    `timing_s/...` metrics (verl's own compute_timing_metrics); the v1 reduction over the samples'
    extra_fields gives the same numbers."""
    from types import SimpleNamespace

    from verl.trainer.ppo.metric_utils import compute_timing_metrics

    from kvtier.rollout.cpu.local import chat_batch
    from kvtier.rollout.metrics import eviction_metrics
    from kvtier.rollout.trainer_hooks import KVTierAgentLoopManager, KVTierMetricsMixin, v1_eviction_metrics

    assert isinstance(rollout.agent, KVTierAgentLoopManager)
    val = rollout.generate_sequences(chat_batch(CHAT_PROMPTS[:2], validate=True))
    assert list(val.non_tensor_batch["kvtier_budget"]) == [None, None]
    assert list(val.non_tensor_batch["kvtier_eviction_events"]) == [None, None]

    out = rollout.generate_sequences(chat_batch(CHAT_PROMPTS))
    assert all(b == BUDGET for b in out.non_tensor_batch["kvtier_budget"])
    expected = eviction_metrics(out)
    assert expected["rollout/kvtier/eviction_events/mean"] > 0
    timing = out.meta_info["timing"]
    assert {k: timing[k] for k in expected} == expected
    # RayPPOTrainer.fit: timing_raw.update(gen_output.meta_info["timing"]), then
    # metrics.update(compute_timing_metrics(batch, timing_raw))
    timing_raw = {"gen": 1.0, **timing}
    logged = compute_timing_metrics(batch=out, timing_raw=timing_raw)
    assert logged["timing_s/rollout/kvtier/eviction_events/mean"] == expected["rollout/kvtier/eviction_events/mean"]
    assert logged["timing_s/rollout/kvtier/tokens_evicted/max"] == expected["rollout/kvtier/tokens_evicted/max"]

    # v1: the samples' extra_fields as the TransferQueue returns them (one padding sample is left out)
    cols = [c for c in out.non_tensor_batch if c.startswith("kvtier_")]
    fields = [{c: out.non_tensor_batch[c][i] for c in cols} for i in range(len(out))] + [{"kvtier_budget": 1}]
    meta = SimpleNamespace(keys=[f"k{i}" for i in range(len(fields))], partition_id="train",
                           tags=[{}] * len(out) + [{"is_padding": True}])
    got = v1_eviction_metrics(meta, kv_batch_get=lambda keys, partition_id, select_fields: {"extra_fields": fields})
    assert got == expected

    class FakeTrainer:                                    # verl's PPOTrainer._compute_metrics signature
        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            metrics["training/global_step"] = global_steps

    class Trainer(KVTierMetricsMixin, FakeTrainer):
        pass

    import kvtier.rollout.trainer_hooks as hooks

    saved = hooks.v1_eviction_metrics
    hooks.v1_eviction_metrics = lambda batch: got
    try:
        metrics = {}
        Trainer()._compute_metrics(meta, metrics, {}, global_steps=3, epoch=0)
    finally:
        hooks.v1_eviction_metrics = saved
    assert metrics == {"training/global_step": 3, **expected}


def test_replica_sleep_drains_then_wake_resumes(rollout):
    """In hybrid/colocated mode, sleep first drains: running requests are aborted (stop_reason
    "aborted"), new ones park until wake_up and then run."""
    replica, server = rollout.replicas[0], rollout.server

    def set_mode(mode, free):
        def f(s, mode=mode, free=free):
            old = (s.rollout_mode, s.free_cache_engine)
            s.rollout_mode, s.free_cache_engine = mode, free
            return old
        return ray.get(server.__ray_call__.remote(f))

    old = set_mode("hybrid", True)
    try:
        long_req = server.generate.remote(prompt_ids=ID_PROMPTS[1], sampling_params={"max_tokens": 1800,
                                          "ignore_eos": True}, request_id="sleep-drain-long")
        deadline = time.monotonic() + 120
        while ray.get(server.num_unfinished_requests.remote()) == 0:
            assert time.monotonic() < deadline, "the long request never reached the engine"
            time.sleep(0.05)
        asyncio.run(replica.sleep())
        first = ray.get(long_req, timeout=120)
        assert first.stop_reason == "aborted" and len(first.token_ids) < 1800
        parked = server.generate.remote(prompt_ids=ID_PROMPTS[0], sampling_params={"max_tokens": 8},
                                        request_id="sleep-drain-parked")
        ready, _ = ray.wait([parked], timeout=2.0)
        assert not ready, "a request ran while the replica slept"
        asyncio.run(replica.wake_up())
        after = ray.get(parked, timeout=120)
        assert after.stop_reason == "completed" and len(after.token_ids) == 8
    finally:
        asyncio.run(replica.wake_up())
        set_mode(*old)


def test_weight_bucket_checks_shared_memory_first(monkeypatch, tmp_path):
    """/dev/shm (Docker's default is 64 MiB) is checked before a bucket is written: a clear error naming
    the bytes needed and available, and nothing reaches the engine."""
    from collections import namedtuple

    import kvtier.rollout.server as srv
    import kvtier.rollout.weight_sync as ws

    calls = []

    class Engine:
        async def collective_rpc(self, *args, **kwargs):
            calls.append(args)
            return [1]

    server = srv.KVTierServer.__new__(srv.KVTierServer)
    server.engine = Engine()
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(ws.shutil, "disk_usage", lambda d: Usage(64 << 20, 64 << 20, 1 << 20))
    bucket = [("model.embed_tokens.weight", torch.zeros(1024, 1024))]          # 4 MiB
    with pytest.raises(ws.WeightSyncSpaceError, match=r"has 1048576 bytes \(1.0 MiB\) free, a weight bucket "
                                                      r"needs 4\d{6} bytes \(4.0 MiB\).*shm-size"):
        asyncio.run(server.load_weights_bucket(bucket))
    assert calls == []
    monkeypatch.setattr(ws.shutil, "disk_usage", lambda d: Usage(1 << 30, 0, 1 << 30))
    monkeypatch.setattr(ws, "_shm_dir", lambda: str(tmp_path))
    assert asyncio.run(server.load_weights_bucket(bucket)) == 1 and len(calls) == 1
    assert list(tmp_path.iterdir()) == []                  # the bucket file is removed after loading


def test_request_counters_never_dropped_while_running():
    """EvictionStats keeps every running request's counters (the old LRU dropped the oldest after 4,096
    requests, so long samples in big batches reported zero) and bounds finished ones by count and age."""
    from kvtier.engine.stats import EvictionStats

    now = [0.0]
    st = EvictionStats(keep_finished=4, keep_finished_s=10.0, max_finished=8, clock=lambda: now[0])
    st.record_round("long", "random", 5)                 # a long sample, started first
    for i in range(10_000):
        st.request(f"r{i}").events += 1
    assert st.requests["long"].events == 1 and st.running == 10_001
    st.finish([f"r{i}" for i in range(6)])               # 6 finished, just now: all kept (too young to drop)
    assert all(f"r{i}" in st.requests for i in range(6))
    now[0] = 11.0
    st.finish(["r6"])                                    # 7 finished; > 4 and the old ones aged out
    assert [f"r{i}" in st.requests for i in range(7)] == [False, False, False, True, True, True, True]
    st.finish([f"r{i}" for i in range(7, 20)])           # a burst: max_finished caps memory whatever the age
    assert sum(f"r{i}" in st.requests for i in range(20)) == 8
    assert "long" in st.requests and st.requests["long"].tokens_evicted == 5


def test_first_turn_prefixes_follow_request_ids():
    from kvtier.rollout.prompt_protection import FirstPrompts

    fp = FirstPrompts(capacity=2, per_id=2)
    assert fp.prefix_len("a", [1, 2, 3]) == 3                  # a first prompt: all of it
    assert fp.prefix_len("a", [1, 2, 3, 9, 9]) == 3            # the next turn / a resumed partial rollout
    assert fp.prefix_len("a", [1, 2, 4, 9]) == 4               # same id, another conversation: new first prompt
    assert fp.prefix_len("a", [1, 2, 4, 9, 5]) == 4
    assert fp.prefix_len("a", [1, 2, 3, 9, 9, 7]) == 3         # both remembered (det-<n> ids repeat)
    fp.prefix_len("b", [5]), fp.prefix_len("c", [6])           # capacity 2: "a" forgotten
    assert fp.prefix_len("a", [1, 2, 3, 9]) == 4


def test_sample_counters_add_up_every_call_of_a_resumed_partial_rollout():
    """No engine: verl's FullyAsyncLLMServerClient resubmits an aborted partial rollout and rebuilds the output
    without any kvtier field; with kvtier's counting mixin under it, the trajectory's totals cover both
    attempts (sums; peak blocks the max; first call's budget and request id), and the totals land in the
    agent-loop output's extra_fields. Outside a trajectory nothing is recorded."""
    from types import SimpleNamespace

    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
    from verl.workers.rollout.replica import TokenOutput

    from kvtier.rollout.sample_counters import CountingClientMixin, apply_totals, counting, counting_client

    replies = []

    def reply(tokens, stop, events, evicted, peak, preempted=0, rid="x"):
        return TokenOutput(token_ids=tokens, log_probs=[-1.0] * len(tokens), stop_reason=stop,
                           num_preempted=preempted,
                           extra_fields={"global_steps": 1, "kvtier_budget": 64, "kvtier_request_id": rid,
                                         "kvtier_protect_prefix": None, "kvtier_eviction_events": events,
                                         "kvtier_tokens_evicted": evicted, "kvtier_peak_kv_blocks": peak,
                                         "kvtier_preemptions": preempted, "kvtier_seed": len(rid),
                                         "kvtier_buffer": 16, "kvtier_policy": "random",
                                         "kvtier_policy_params": '{"protect_prefix": %d}' % len(rid)})

    calls = []

    class Server:
        class generate:                               # server.generate.remote(**kwargs) -> awaitable
            @staticmethod
            async def remote(**kwargs):
                calls.append(kwargs)
                return replies.pop(0)

    async def acquire(request_id, **extra):
        return "s0", Server

    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(
        name="kvtier", full_determinism=False, response_length=100)))
    client = counting_client(FullyAsyncLLMServerClient(config=config, load_balancer_handle=None))
    assert isinstance(client, FullyAsyncLLMServerClient) and isinstance(client, CountingClientMixin)
    assert counting_client(client) is client
    plain = counting_client(LLMServerClient(config=config, load_balancer_handle=None))
    assert type(plain).__mro__[1:3] == (CountingClientMixin, LLMServerClient)
    client._acquire_server = acquire
    client._release_server = lambda server_id, request_id=None: None

    async def trajectory():
        with counting() as counters:
            out = await client.generate("traj-1", prompt_ids=[5, 6, 7], sampling_params={})
            agent_output = SimpleNamespace(extra_fields=dict(out.extra_fields))
            return out, counters.totals(), apply_totals(agent_output), agent_output

    replies[:] = [reply([1, 2, 3], "aborted", 2, 40, 5, rid="x-1"), reply([4, 5], "completed", 3, 70, 4, 1, "x-2")]
    out, totals, applied, agent_output = asyncio.run(trajectory())
    assert out.token_ids == [1, 2, 3, 4, 5] and not any(k.startswith("kvtier_") for k in out.extra_fields)
    # `protect: first_turn` without full_determinism: each attempt reaches the server under a fresh request
    # id, but with the trajectory's id as kvtier_session, and the server keys its first prompts on that
    assert len(calls) == 2 and calls[0]["request_id"] != calls[1]["request_id"]
    assert [c["sampling_params"]["kvtier_session"] for c in calls] == ["traj-1", "traj-1"]
    from kvtier.rollout.prompt_protection import FirstPrompts

    fp = FirstPrompts()
    assert [fp.prefix_len(c["sampling_params"]["kvtier_session"], c["prompt_ids"]) for c in calls] == [3, 3]
    assert totals == applied == {"kvtier_budget": 64, "kvtier_request_id": "x-1", "kvtier_protect_prefix": None,
                                 "kvtier_eviction_events": 5, "kvtier_tokens_evicted": 110,
                                 "kvtier_peak_kv_blocks": 5, "kvtier_preemptions": 1, "kvtier_generate_calls": 2,
                                 "kvtier_seed": 3, "kvtier_buffer": 16, "kvtier_policy": "random",
                                 "kvtier_policy_params": '{"protect_prefix": 3}'}   # the first call's
    assert agent_output.extra_fields["kvtier_eviction_events"] == 5 and agent_output.extra_fields["global_steps"] == 1
    # full attention (counters None) stays None; a call rejected at the admission gate (no kvtier fields) and
    # calls outside a trajectory are not counted
    replies[:] = [TokenOutput(token_ids=[], stop_reason="completed", extra_fields={"global_steps": 1})]
    assert asyncio.run(client.generate("traj-2", prompt_ids=[1], sampling_params={})).token_ids == []
    from kvtier.rollout.sample_counters import SampleCounters

    c = SampleCounters()
    c.add({"kvtier_budget": None, "kvtier_eviction_events": None, "kvtier_peak_kv_blocks": None})
    c.add({"global_steps": 1})
    c.add({"kvtier_budget": None, "kvtier_eviction_events": None, "kvtier_peak_kv_blocks": None})
    assert c.totals()["kvtier_eviction_events"] is None and c.totals()["kvtier_generate_calls"] == 2


def test_compressed_requests_get_an_eviction_seed_the_learner_can_rederive_from():
    """#24 item 2: a compressed request without `kvtier_seed` gets one (written into its extra_args, so the
    engine draws with it); a request that has one, a full-attention request and eviction off are left as
    they are; under verl's full_determinism the seed is a function of the run's seed and the request id."""
    from types import SimpleNamespace

    from kvtier.rollout.request_stats import eviction_seed, seeded_spec
    from kvtier.rollout.settings import KVTierRolloutSettings

    settings = KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "buffer": 16}})
    params = SimpleNamespace(extra_args=None)
    spec = seeded_spec(settings, params, "req-1", None)
    assert spec.budget == 64 and isinstance(spec.seed, int) and params.extra_args == {"kvtier_seed": spec.seed}
    again = SimpleNamespace(extra_args=dict(params.extra_args))
    assert seeded_spec(settings, again, "req-1", None).seed == spec.seed and again.extra_args == params.extra_args
    full = SimpleNamespace(extra_args={"kvtier_budget": "full"})
    assert seeded_spec(settings, full, "req-2", None).budget is None and full.extra_args == {"kvtier_budget": "full"}
    off = KVTierRolloutSettings.from_custom({"kvtier": {"budget": 64, "enabled": False}})
    assert seeded_spec(off, SimpleNamespace(extra_args=None), "req-3", None) is None
    assert eviction_seed("req-1", 7) == eviction_seed("req-1", 7) != eviction_seed("req-2", 7)
    assert len({eviction_seed("req-1", None) for _ in range(8)}) > 1


def test_chains_task_dataset_and_reward_for_verl(tmp_path):
    """#24 item 1: the reasoner's task family as verl's dataset (train and held-out splits, no held-out
    problem in the train split) and the graded reward; through the chat template a run passes, a prompt
    has exactly the plain completion prompt's token ids."""
    import pandas as pd
    from transformers import AutoTokenizer

    from kvtier.rollout.chains_task import PROMPT_ONLY, compute_score, write_dataset
    from kvtier.tasks.chains import eval_problems

    train, val = write_dataset(tmp_path, train=12, val=4, kinds=("local", "needle"))
    tr, va = pd.read_parquet(train), pd.read_parquet(val)
    assert len(tr) == 24 and len(va) == 8 and list(va["ability"][:2]) == ["chains-local", "chains-needle"]
    held = {p.prompt for kind in ("local", "needle") for p in eval_problems(4, kind)}
    assert {r[0]["content"] for r in va["prompt"]} == held and not held & {r[0]["content"] for r in tr["prompt"]}
    first = eval_problems(1, "local")[0]
    gold = va["reward_model"][0]["ground_truth"]
    assert gold == first.answer
    assert compute_score("kvtier_chains", first.trace, gold) == 1.0          # the gold trace earns the reward
    assert compute_score("kvtier_chains", first.trace[:-1], gold) == 0.0     # a truncated box is no answer
    assert compute_score("kvtier_chains", "\\boxed{99}" if gold != "99" else "\\boxed{98}", gold) == 0.0
    assert compute_score("kvtier_chains", "no answer", gold) == 0.0
    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "src/kvtier/models/reasoner"))
    templated = tok.apply_chat_template(list(va["prompt"][0]), chat_template=PROMPT_ONLY, add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert templated == tok(first.prompt)["input_ids"]
