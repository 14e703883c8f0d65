"""Table 10 / Table 9 setting on one GPU: batched decoding in Hugging Face transformers (no paging, no
vLLM) at Qwen3-4B shapes with dummy weights, through kvtier's transformers reference engine.

What it measures (prints one JSON object):

* ``decode``: for each method (``full`` and the eviction policies), decode throughput of a batch whose
  caches start in steady state — compressed: K + r entries per KV head (prompt + a scatter of older
  positions + the buffer) at logical position ``--context``; full: ``--full-context`` entries — for
  ``--steps`` decode steps with eviction rounds on the engine's schedule (every r steps). Reports tok/s,
  ms per step, rounds and ms per round (CUDA events), the cache size per sequence, and the largest batch
  the GPU's memory admits for that cache (the batch Table 10 bisects for; here computed from memory,
  with the measured throughput at the run batch).
* ``rounds``: ms per eviction round for every policy at Table 9's shapes (36 layers, 8 KV heads,
  head_dim 128, K=1024, r=64), from kvtier.benchmarks.rounds.

Weights are random (built from a Qwen3Config; nothing is downloaded), so tokens are meaningless; the
arithmetic and memory traffic are the real model's. It needs torch, transformers and pydantic only (no vLLM),
and runs as a module from the checkout's `src/` (no install needed). CPU smoke test: ``--tiny --device cpu``.

    PYTHONPATH=src python -m kvtier.benchmarks.gpu_table10                      # H200, < 5 min
    PYTHONPATH=src python -m kvtier.benchmarks.gpu_table10 --tiny --device cpu  # seconds
"""

from __future__ import annotations

import argparse
import json
import time

QWEN3_4B = dict(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policies", default="full,random,snapkv,rkv,vase,recency",
                    help="comma-separated: full and registered policies")
    ap.add_argument("--budget", type=int, default=None, help="K (default 3072; tiny 32)")
    ap.add_argument("--buffer", type=int, default=None, help="r (default 64; tiny 8)")
    ap.add_argument("--batch", type=int, default=None, help="batch for compressed methods (default 192; tiny 3)")
    ap.add_argument("--full-batch", type=int, default=None, help="batch for full attention (default 28; tiny 2)")
    ap.add_argument("--context", type=int, default=None, help="logical position the compressed runs start at")
    ap.add_argument("--full-context", type=int, default=None, help="cached entries full attention starts with")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per method")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds-repeats", type=int, default=None, help="repeats for the Table 9 round timing (0 = skip)")
    ap.add_argument("--mem-fraction", type=float, default=0.92, help="of GPU memory, for the largest-batch estimate")
    ap.add_argument("--time-limit", type=float, default=260.0, help="skip remaining methods past this many seconds")
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile this many decode steps (and one round) of the first compressed method")
    for k in QWEN3_4B:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    a = ap.parse_args(argv)
    base = TINY if a.tiny else QWEN3_4B
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    d = (dict(budget=32, buffer=8, batch=3, full_batch=2, context=96, full_context=64, prompt_len=16, steps=20,
              warmup=2, rounds_repeats=2) if a.tiny else
         dict(budget=3072, buffer=64, batch=192, full_batch=28, context=8192 + 64, full_context=16384, prompt_len=1024,
              steps=128, warmup=8, rounds_repeats=10))
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def build_model(a, device, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=max(40960, a.full_context + a.steps + 16),
                      rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to(device=device, dtype=dtype).eval()
    return model


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_method(engine, method: str, a, device, gen, profile: int = 0) -> dict:
    """Steady-state decode of one batch with one method."""
    import torch

    from kvtier.engine.config import EvictionSpec
    from kvtier.reference import Request, SequenceState

    full = method == "full"
    B = a.full_batch if full else a.batch
    K, r, P = a.budget, a.buffer, a.prompt_len
    spec = EvictionSpec(budget=None) if full else EvictionSpec(policy=method, budget=K, buffer=r, seed=0)
    policy = None if full else spec.make_policy()
    needs = set() if policy is None else set(policy.needs)
    start_len = a.full_context if full else K + r
    logical0 = a.full_context if full else a.context
    warm_half = max(a.warmup // 2, 1)
    cap = (start_len + 2 * (warm_half + 1) + a.steps + 1) if full else K + 2 * r + 1
    batch = engine.new_batch(B, cap, track_attention="attention" in needs,
                             query_window=engine.query_window if "queries" in needs else 0, keep_records=False)
    batch.batched_draws = True      # order-free policies: one draw for all sequences due at a step
    c = batch.cache
    for l in range(c.L):
        c.keys[l][:, :, :start_len].normal_(generator=gen)
        c.values[l][:, :, :start_len].normal_(generator=gen)
        if c.queries is not None:
            c.queries[l].normal_(generator=gen)
        if c.attention is not None:
            c.attention[l][:, :, :start_len].uniform_(generator=gen)
    if full:
        c.positions[:, :, :, :start_len] = torch.arange(start_len, device=c.device)
    else:
        n_old = K - P                                          # older generated positions kept per head
        span = logical0 - r - P
        pos = torch.empty(c.L, B, c.H, start_len, dtype=torch.long, device=c.device)
        pos[..., :P] = torch.arange(P, device=c.device)
        scatter = torch.rand(c.L * B * c.H, span, generator=gen, device=c.device).argsort(dim=1)[:, :n_old]
        pos[..., P:K] = (P + scatter.sort(dim=1).values).view(c.L, B, c.H, n_old)
        pos[..., K:] = torch.arange(logical0 - r, logical0, device=c.device)
        c.positions[:, :, :, :start_len] = pos
    for b in range(B):
        c.lengths[b] = start_len
        eg = torch.Generator(device=c.device)
        eg.manual_seed(1000 + b)
        s = SequenceState(Request([0] * P, spec, max_new_tokens=1 << 30, req_id=f"{method}/{b}"), spec, policy, P, eg,
                          None)
        s.decoded = logical0 - P
        batch.seqs[b] = s
    rows = list(range(B))
    toks = [1] * B
    cuda = str(device).startswith("cuda")
    round_ms, rounds = [], 0
    prof_table = None

    def one_step():
        nonlocal toks, rounds
        due = batch.due_rows()
        if due:
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                batch.run_rounds(due)
                e1.record()
                round_ms.append((e0, e1, len(due)))
            else:
                t0 = time.perf_counter()
                batch.run_rounds(due)
                round_ms.append(((time.perf_counter() - t0) * 1e3, None, len(due)))
            rounds += len(due)
        pos = [batch.seqs[b].prompt_len + batch.seqs[b].decoded for b in rows]
        logits = batch.step(rows, toks, pos)
        for b in rows:
            batch.seqs[b].decoded += 1
        toks = logits.argmax(dim=-1).tolist()

    with torch.no_grad():
        # Attention backend per method, picked on warm-up steps: fused SDPA vs the explicit grouped
        # softmax (whichever is faster at this batch and cache length; same numerics class).
        timings = {}
        half = warm_half
        for choice in (True, False):             # first touch of each path (cuDNN plans, allocator)
            batch.attention.sdpa_decode = choice
            one_step()
        for choice in (True, False):
            batch.attention.sdpa_decode = choice
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(half):
                one_step()
            _sync(device)
            timings[choice] = (time.perf_counter() - t0) / half
        batch.attention.sdpa_decode = min(timings, key=timings.get)
        if profile:
            from torch.profiler import ProfilerActivity, profile as tprofile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            # align so a round falls inside the profiled window
            while not batch.due_rows():
                one_step()
            _sync(device)
            with tprofile(activities=acts) as prof:
                for _ in range(profile):
                    one_step()
                _sync(device)
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            prof_table = {
                "by_device_time": prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60),
                "by_cpu_time": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                                         max_name_column_width=60),
            }
        _sync(device)
        round_ms.clear()
        rounds = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            one_step()
        _sync(device)
        elapsed = time.perf_counter() - t0
    if cuda:
        ms = [e0.elapsed_time(e1) for e0, e1, _ in round_ms]
    else:
        ms = [m for m, _, _ in round_ms]
    per_seq = (sum(t[0].numel() * t.element_size() for t in c.keys + c.values)
               + c.positions[:, 0].numel() * 8)
    out = {
        "batch": B, "steps": a.steps, "cache_entries_per_head": cap - 1,
        "tok_per_s": round(B * a.steps / elapsed, 1), "ms_per_step": round(1e3 * elapsed / a.steps, 3),
        "round_steps": len(ms), "sequence_rounds": rounds,
        "ms_per_round_step": round(sum(ms) / len(ms), 3) if ms else None,
        "round_share_of_time": round(sum(ms) / (1e3 * elapsed), 4) if ms else 0.0,
        "cache_mb_per_sequence": round(per_seq / 2**20, 2),
        "attention": "sdpa" if batch.attention.sdpa_decode else "grouped-matmul",
        "warmup_ms_per_step": {("sdpa" if k else "grouped-matmul"): round(1e3 * v, 2) for k, v in timings.items()},
    }
    if cuda:
        out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if prof_table is not None:
        out["profile"] = prof_table
    batch = c = None  # drop the cache before the next method allocates its own
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    import transformers

    from kvtier.reference import ReferenceEngine

    t_start = time.perf_counter()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    if device == "cpu" and dtype == torch.bfloat16 and a.tiny:
        dtype = torch.float32
    model = build_model(a, device, dtype)
    engine = ReferenceEngine(model, device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    result = {
        "setting": "Table 10: HF transformers batched decoding, dense per-head caches, no paging (dummy weights)",
        "device": device, "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype).replace("torch.", ""),
        "shapes": {k: getattr(a, k) for k in QWEN3_4B} | {"budget": a.budget, "buffer": a.buffer,
                                                         "prompt_len": a.prompt_len, "context": a.context,
                                                         "full_context": a.full_context},
        "params_b": round(n_params / 1e9, 3), "weights_gb": round(weights_gb, 2),
        "model_build_s": round(time.perf_counter() - t_start, 1),
        "decode": {}, "skipped": [],
    }
    gen = torch.Generator(device=device).manual_seed(0)
    total_mem = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else None
    profiled = False
    for method in [m.strip() for m in a.policies.split(",") if m.strip()]:
        if time.perf_counter() - t_start > a.time_limit:
            result["skipped"].append(method)
            continue
        try:
            prof = a.profile if (a.profile and method != "full" and not profiled) else 0
            profiled = profiled or bool(prof)
            r = run_method(engine, method, a, device, gen, profile=prof)
        except Exception as exc:  # one method failing (e.g. out of memory) must not lose the others
            r = {"error": f"{type(exc).__name__}: {exc}"}
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if total_mem and "cache_mb_per_sequence" in r:
            # Largest batch by memory: KV for the method's cache bound at 32k generations (full) or K+2r.
            free = a.mem_fraction * total_mem - weights_gb * 2**30 - 2 * 2**30
            per_seq_32k = (2 * a.layers * a.kv_heads * a.head_dim * 2) * (
                (a.prompt_len + 32768) if method == "full" else (a.budget + 2 * a.buffer))
            r["est_max_batch_32k"] = int(free // per_seq_32k)
        result["decode"][method] = r
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    full = result["decode"].get("full", {}).get("tok_per_s")
    if full:
        for m, r in result["decode"].items():
            if "tok_per_s" in r:
                r["x_full_same_run"] = round(r["tok_per_s"] / full, 2)
    if a.rounds_repeats > 0 and time.perf_counter() - t_start < a.time_limit:
        from kvtier.benchmarks.rounds import RoundShapes, run_rounds_bench

        shapes = (RoundShapes(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, budget=a.budget, buffer=a.buffer,
                              query_heads=a.heads, prompt_len=a.prompt_len // 2, batch=1) if a.tiny else
                  RoundShapes(layers=36, kv_heads=8, head_dim=128, budget=1024, buffer=64, query_heads=32,
                              prompt_len=128, batch=1))
        pols = [m for m in a.policies.split(",") if m and m != "full"]
        try:
            rb = run_rounds_bench(shapes, device=device, repeats=a.rounds_repeats, policies=pols)
            result["rounds"] = {"shapes": rb["shapes"], "full_gather_floor": rb["full_gather_floor"],
                                "policies": rb["policies"]}
        except Exception as exc:
            result["rounds"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
