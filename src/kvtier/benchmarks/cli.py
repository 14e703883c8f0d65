"""`kvtier bench ...`: the benchmark commands (each prints JSON). `bench serve` is in serve_cli.py,
`bench goodput` in goodput_cli.py, `bench rl` and `bench rl-table` in rl_cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print JSON).")


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2))


@bench_app.command("rounds")
def bench_rounds(
    layers: int = typer.Option(36, help="Transformer layers (one eviction per layer per round)."),
    kv_heads: int = typer.Option(8, "--kv-heads"),
    head_dim: int = typer.Option(128, "--head-dim"),
    budget: int = typer.Option(1024, help="K, kept candidates per head."),
    buffer: int = typer.Option(64, help="r, the never-scored recent buffer."),
    query_heads: int = typer.Option(32, "--query-heads"),
    prompt_len: int = typer.Option(128, "--prompt-len"),
    batch: int = typer.Option(1),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    repeats: int = typer.Option(20),
    policies: Optional[str] = typer.Option(None, help="Comma-separated policy names (default: all registered)."),
    threads: int = typer.Option(1, help="CPU threads (0 = torch default)."),
) -> None:
    """Milliseconds per eviction round for every policy, plus the full-gather compaction floor."""
    from kvtier.benchmarks.rounds import RoundShapes, run_rounds_bench

    shapes = RoundShapes(layers=layers, kv_heads=kv_heads, head_dim=head_dim, budget=budget, buffer=buffer,
                         query_heads=query_heads, prompt_len=prompt_len, batch=batch)
    names = policies.split(",") if policies else None
    _print_json(run_rounds_bench(shapes, device=device, repeats=repeats, policies=names, threads=threads or None))


@bench_app.command("compaction")
def bench_compaction(
    device: str = typer.Option("cpu", help="cpu or cuda"),
    requests: Optional[str] = typer.Option(None, help="Due requests per step, comma-separated (default: cuda 1,64,256; cpu 1,8)."),
    budgets: str = typer.Option("1024,2048", help="K values, comma-separated."),
    buffer: int = typer.Option(64, help="r, the recent buffer (each due request holds K + 2r entries)."),
    layers: int = typer.Option(36),
    kv_heads: int = typer.Option(8, "--kv-heads"),
    head_dim: int = typer.Option(128, "--head-dim"),
    block_size: int = typer.Option(16, "--block-size"),
    query_heads: int = typer.Option(32, "--query-heads", help="For policies reading queries (snapkv, rkv)."),
    prompt_len: int = typer.Option(64, "--prompt-len"),
    layouts: str = typer.Option("flash,cpu", help="Cache layouts: flash, cpu (vLLM's CPU page; its own op when importable), cpu_plain."),
    policies: str = typer.Option("random,snapkv,rkv"),
    repeats: Optional[int] = typer.Option(None, help="Timed steps per cell after the checked warm-up (default: cuda 10, cpu 3)."),
    dtype: str = typer.Option("bfloat16"),
    max_gb: Optional[float] = typer.Option(None, "--max-gb", help="Skip cells whose estimated peak memory (cache, its pristine copy, row indices) is larger (default: cpu 10 GiB, caches up to ~4 GiB; cuda 75% of free memory)."),
    cpu_writer: str = typer.Option("auto", "--cpu-writer", help="Layout cpu: auto, vllm or emulated."),
    threads: int = typer.Option(1, help="CPU threads (0 = torch default)."),
    seed: int = typer.Option(0),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON here."),
) -> None:
    """ms per engine step for compacting every due request (selection + hole-filling row copies) on a
    paged cache, against a full per-head gather of the same requests, with an exactness check."""
    from kvtier.benchmarks.compaction import CompactionShapes, run_compaction_bench

    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731

    def write(report: dict) -> None:   # after every cell too, so an interrupted run keeps its cells
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    shapes = CompactionShapes(layers=layers, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                              buffer=buffer, query_heads=query_heads, prompt_len=prompt_len)
    report = run_compaction_bench(device=device, requests=ints(requests) if requests else None, budgets=ints(budgets),
                                  shapes=shapes, layouts=layouts.split(","), policies=policies.split(","),
                                  repeats=repeats, dtype=dtype, threads=threads or None, max_gb=max_gb,
                                  seed=seed, cpu_writer=cpu_writer, progress=write if out is not None else None)
    _print_json(report)
    if out is not None:
        write(report)


@bench_app.command("throughput")
def bench_throughput(
    requests: int = typer.Option(16, help="Offered load: requests submitted at once."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens"),
    gen_tokens: int = typer.Option(2048, "--gen-tokens", help="Generated per request (ignore_eos)."),
    budget: int = typer.Option(256, help="K for compressed arms."),
    buffer: int = typer.Option(64),
    policies: str = typer.Option("full,random,snapkv", help="Arms: full, stock (unpatched vLLM), POLICY or POLICY:K."),
    kv_bytes: Optional[int] = typer.Option(None, "--kv-bytes", help="KV pool bytes (default: 68 usable blocks of the tiny model)."),
    model: Optional[str] = typer.Option(None, help="HF model dir (default: the tiny local Qwen3)."),
    plot: Optional[str] = typer.Option(None, help="Write a PNG bar chart here."),
    policy_params: Optional[str] = typer.Option(
        None, "--policy-params", help='JSON: per policy, its kvtier_params, e.g. '
        '\'{"triattention": {"calibration": "calib.safetensors"}}\' (file from `kvtier calibrate`).'),
) -> None:
    """Tok/s, peak batch, preemptions and eviction events per arm, and ratios to full attention."""
    from kvtier.benchmarks.throughput import LoadShape, run_throughput_bench
    from kvtier.models.tiny import ensure_tiny_model

    shape = LoadShape(requests=requests, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, budget=budget,
                      buffer=buffer, **({"kv_bytes": kv_bytes} if kv_bytes else {}))
    try:
        per_policy = json.loads(policy_params) if policy_params else {}
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--policy-params must be JSON: {exc}") from None
    if not isinstance(per_policy, dict) or not all(isinstance(v, dict) for v in per_policy.values()):
        raise typer.BadParameter('--policy-params must map policy names to objects: {"POLICY": {...}}')
    report = run_throughput_bench(model or str(ensure_tiny_model()), shape, policies.split(","), plot,
                                  policy_params=per_policy)
    _print_json(report)
    if not report["valid"]:
        raise typer.Exit(2)


@bench_app.command("prefix-cache")
def bench_prefix_cache(
    prompts: int = typer.Option(16, help="Distinct prompts."),
    samples: int = typer.Option(8, help="Samples per prompt (GRPO's n)."),
    prompt_tokens: int = typer.Option(1024, "--prompt-tokens"),
    gen_tokens: int = typer.Option(1024, "--gen-tokens", help="Generated per sample (ignore_eos)."),
    budget: int = typer.Option(1280, help="K of the compressed arms (random protects the prompt: K counts it)."),
    buffer: int = typer.Option(64),
    kv_blocks: int = typer.Option(64, "--kv-blocks", help="Usable KV blocks of the pool (tiny model, 128 tokens each)."),
    arms: str = typer.Option("stock+pc,full,full+pc,k,k+pc", help="stock+pc, full, full+pc, k, k+pc (+pc: prefix caching)."),
    model: Optional[str] = typer.Option(None, help="HF model dir (default: the tiny local Qwen3)."),
    out: Optional[Path] = typer.Option(None, help="Also write the JSON here."),
    plot: Optional[str] = typer.Option(None, help="Write a PNG (tok/s and prompt tokens computed per arm) here."),
) -> None:
    """Shared-prefix workload: prompt tokens computed, hit rate, tok/s and preemptions per arm, with and
    without prefix caching, against stock vLLM with prefix caching at equal KV memory."""
    from kvtier.benchmarks.harness import TINY_BLOCK_BYTES
    from kvtier.benchmarks.prefix_cache import SharedPrefixShape, run_prefix_cache_bench
    from kvtier.models.tiny import ensure_tiny_model

    shape = SharedPrefixShape(prompts=prompts, samples=samples, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                              budget=budget, buffer=buffer, kv_bytes=(kv_blocks + 1) * TINY_BLOCK_BYTES)
    report = run_prefix_cache_bench(model or str(ensure_tiny_model()), shape, arms.split(","), plot)
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    _print_json(report)


@bench_app.command("rollout")
def bench_rollout(
    samples: int = typer.Option(20, help="Prompts in the batch (one response each)."),
    gen_tokens: int = typer.Option(2048, "--gen-tokens", help="Generated per sample (ignore_eos)."),
    budget: int = typer.Option(256, help="K of the compressed arm."),
    buffer: int = typer.Option(64),
    policy: str = typer.Option("random", help="Policy of the compressed arm."),
    full_seqs: int = typer.Option(4, "--full-seqs", help="KV pool size in full-length sequences (prompt + gen)."),
    kv_bytes: Optional[int] = typer.Option(None, "--kv-bytes", help="KV pool bytes (overrides --full-seqs)."),
    prompt_length: int = typer.Option(128, "--prompt-length", help="data.max_prompt_length."),
    temperature: float = typer.Option(1.0),
    server_cpus: Optional[int] = typer.Option(None, "--server-cpus",
                                              help="Ray CPUs = engine threads of the server (default: all cores)."),
    model: Optional[str] = typer.Option(None, help="HF model dir (default: the tiny local Qwen3)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON here."),
) -> None:
    """One long-CoT batch through verl's agent loop (rollout.name=kvtier): wall time, tok/s, preemptions
    and eviction events, compressed vs full attention on the same engine and KV pool."""
    from kvtier.benchmarks.rollout import RolloutShape, run_rollout_bench
    from kvtier.models.tiny import ensure_tiny_model

    shape = RolloutShape(samples=samples, gen_tokens=gen_tokens, prompt_length=prompt_length, budget=budget,
                         buffer=buffer, policy=policy, full_seqs=full_seqs, kv_bytes=kv_bytes,
                         temperature=temperature, server_cpus=server_cpus)
    report = run_rollout_bench(model or str(ensure_tiny_model()), shape)
    _print_json(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    if not report["valid"]:
        raise typer.Exit(2)


@bench_app.command("capacity")
def bench_capacity(
    budget: int = typer.Option(256),
    buffer: int = typer.Option(64),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens"),
    gen_tokens: int = typer.Option(640, "--gen-tokens"),
    policy: str = typer.Option("random"),
    kv_bytes: Optional[int] = typer.Option(None, "--kv-bytes", help="KV pool bytes (default: 32 usable blocks of the tiny model)."),
    model: Optional[str] = typer.Option(None),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", help="Arithmetic only, no engine: traces per KV pool "
                                            "per tier of --config on this GPU (H100, H200; repeatable)."),
    config: Optional[Path] = typer.Option(None, help="With --gpu: the service config (default: configs/gpu.yaml)."),
    markdown: bool = typer.Option(False, "--markdown", help="With --gpu: print the table of docs/deploy.md."),
) -> None:
    """Largest number of concurrent sequences without preemption, measured vs block arithmetic; with --gpu,
    the arithmetic for Qwen3-8B on those GPUs (src/kvtier/benchmarks/capacity.py states the assumptions)."""
    from kvtier.benchmarks.capacity import CapacityShape, run_capacity_bench
    from kvtier.models.tiny import ensure_tiny_model

    if gpu:
        from kvtier.benchmarks.capacity import capacity_markdown, gpu_capacity
        from kvtier.service.config import load_config

        report = gpu_capacity(load_config(config or Path(__file__).resolve().parents[1] / "configs" / "gpu.yaml"), gpu)
        if markdown:
            typer.echo(capacity_markdown(report))
        else:
            _print_json(report)
        return
    shape = CapacityShape(budget=budget, buffer=buffer, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                          policy=policy, **({"kv_bytes": kv_bytes} if kv_bytes else {}))
    report = run_capacity_bench(model or str(ensure_tiny_model()), shape)
    _print_json(report)
    if not report["valid"]:
        raise typer.Exit(2)


@bench_app.command("replay-memory")
def bench_replay_memory(
    layers: int = typer.Option(36, help="Model layers (Qwen3-4B: 36)."),
    kv_heads: int = typer.Option(8, "--kv-heads", help="KV heads per layer (Qwen3-4B: 8)."),
    tokens: int = typer.Option(32768, help="Tokens per sample (prompt + response)."),
    prompt: int = typer.Option(1024),
    budget: int = typer.Option(3072),
    buffer: int = typer.Option(128),
    batch: int = typer.Option(256, help="Samples per training batch."),
    ranks: int = typer.Option(1, help="Learner ranks sharing the batch (1: every sample on one rank)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Samples per forward on a rank."),
    forwards: int = typer.Option(3, help="Replayed forwards per step (reference, old log-probs, update)."),
    store_bytes: Optional[int] = typer.Option(None, "--store-bytes", help="The death store's bound (default: "
                                              "KVTIER_REPLAY_STORE_BYTES or 640 MiB)."),
    workers: int = typer.Option(2, help="Background derivation workers for the critical-path figure (0: skip it)."),
    pool: str = typer.Option("thread", help="The workers: thread or process."),
    worker_samples: int = typer.Option(8, "--worker-samples", help="Samples in the critical-path step."),
    device_seconds: float = typer.Option(0.0, "--device-seconds", help="Device time per sample's forward the "
                                         "workers may overlap (0: none)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON here."),
) -> None:
    """Learner replay's host seconds per sample and per step, and its peak host and device bytes per rank,
    measured while one micro-batch's death tensor is derived and served (exit 1 when the host bytes reach 1 GiB)."""
    from .replay_memory import run_replay_memory_bench

    report = run_replay_memory_bench(layers=layers, kv_heads=kv_heads, tokens=tokens, prompt=prompt, budget=budget,
                                     buffer=buffer, batch=batch, ranks=ranks, micro_batch=micro_batch,
                                     forwards=forwards, store_bytes=store_bytes, workers=workers, pool=pool,
                                     worker_samples=worker_samples, device_seconds=device_seconds)
    _print_json(report)
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    if not report["within_host_limit"]:
        raise typer.Exit(1)


@bench_app.command("table10", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_table10(ctx: typer.Context) -> None:
    """Table 10 / 9 setting: HF batched decoding throughput + round cost at Qwen3-4B shapes, dummy weights
    (arguments as `python -m kvtier.benchmarks.gpu_table10`: --tiny --device cpu for a smoke run)."""
    from .gpu_table10 import main

    main(list(ctx.args))


def register(app: typer.Typer) -> None:
    """Add `kvtier bench` to the `kvtier` CLI."""
    from .goodput_cli import register as register_goodput
    from .rl_cli import register as register_rl
    from .serve_cli import register as register_serve

    app.add_typer(bench_app, name="bench")
    register_serve(app, bench_app)   # kvtier bench serve
    register_goodput(bench_app)      # kvtier bench goodput
    register_rl(bench_app)           # kvtier bench rl, rl-table
