"""`kvtier bench serve`: kvtier vs stock vLLM's and Ray Serve LLM's OpenAI servers (src/kvtier/benchmarks/serve.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


DTYPES = ("bfloat16", "float16", "float32")


def engine_settings(config: Optional[Path], kv_cache_bytes: Optional[str], max_num_seqs: Optional[int],
                    max_model_len: Optional[int], default: Optional[Path] = None, dtype: Optional[str] = None):
    """(service config, EngineSettings every arm gets) from a one-engine service YAML and the overrides;
    `max_num_seqs: auto` is resolved as `kvtier serve` resolves it; the dtype is the engine's
    `engine_kwargs.dtype` (`auto`: float32 on a CPU without native bf16, else the model's bfloat16) unless
    overridden."""
    from kvtier.benchmarks.servers import EngineSettings
    from kvtier.service.app import resolve_model_path
    from kvtier.service.config import DEFAULT_CONFIG, load_config, parse_bytes
    from kvtier.service.sizing import engine_dtype, resolved_engine_kwargs

    cfg = load_config(config or default or DEFAULT_CONFIG)
    if len(cfg.engines) != 1:
        raise typer.BadParameter("the config must have exactly one engine (every arm copies it)", param_hint="--config")
    (name, eng), = cfg.engines.items()
    if kv_cache_bytes is not None:
        eng.kv_cache_bytes = parse_bytes(kv_cache_bytes)
    if max_model_len is not None:
        eng.max_model_len = max_model_len
    if dtype is not None:
        eng.engine_kwargs["dtype"] = dtype
    dtype = engine_dtype(eng)[0] or "bfloat16"          # `auto`: float32 on a CPU without native bf16
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}", param_hint="--dtype")
    path = resolve_model_path(eng.model)
    seqs = max_num_seqs or resolved_engine_kwargs(cfg, name, path)[0].get("max_num_seqs")
    if eng.kv_cache_bytes is None or seqs is None:
        raise typer.BadParameter("the engine needs kv_cache_bytes and max_num_seqs (or auto) so every arm gets the same")
    return cfg, EngineSettings(model_path=path, model_id=cfg.model_id(name), kv_cache_bytes=eng.kv_cache_bytes,
                               max_model_len=eng.max_model_len, max_num_seqs=int(seqs), dtype=dtype)


def emit(result: dict, out: Optional[Path], plot: Optional[Path], draw) -> None:
    """Print the JSON, write it to `out` and the plot to `plot` when given."""
    text = json.dumps(result, indent=2)
    typer.echo(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(result, plot)


CLIENT_NICE_HELP = ("The benchmark client's CPU priority against the servers it measures (-20..0; negative needs "
                    "root), every arm alike: on a small box the client shares the cores (docs/serving.md). "
                    "Default: left as it is.")


def check_client_nice(client_nice: Optional[int]) -> None:
    """--client-nice: refused here, before any server starts, if it cannot be applied."""
    if client_nice is None:
        return
    from kvtier.benchmarks.client_clock import client_priority

    try:
        with client_priority(client_nice) as how:
            typer.echo(f"benchmark client while it measures: {how}", err=True)
    except (ValueError, PermissionError) as e:
        raise typer.BadParameter(str(e), param_hint="--client-nice") from None


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("serve")
    def bench_serve(
        config: Optional[Path] = typer.Option(None, "--config", "-c", help="Service YAML whose (single) engine "
                                              "every arm copies (default: src/kvtier/configs/local.yaml)."),
        arms: str = typer.Option("stock,rayllm,full,auto", help="Comma-separated: stock, rayllm, full, auto."),
        workloads: str = typer.Option("idle,short,long", help="Comma-separated: idle, short, long."),
        runs: int = typer.Option(1, help="Repeat every arm and workload (ratios and targets per run)."),
        kv_cache_bytes: Optional[str] = typer.Option(None, "--kv-cache-bytes", help="Override the engine's KV pool (e.g. 32MiB)."),
        max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Override (default: the config's, `auto` resolved)."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Override the engine's max_model_len."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="Every arm's model (and KV cache) dtype: bfloat16, "
                                            "float16 or float32 (default: the config's engine_kwargs.dtype; auto "
                                            "or none: float32 on a CPU without AVX512-BF16/AMX, whose bfloat16 "
                                            "matmuls take torch's slow path, else the model's bfloat16; float32 "
                                            "KV takes twice the bytes for the same tokens, docs/serving.md)."),
        idle: str = typer.Option("64x64x32@1", help="idle workload (one request at a time; 64 so a p99 is not just the worst request): PROMPTSxINPUTxOUTPUT@CONCURRENCY."),
        short: str = typer.Option("64x64x128@16", help="short workload: PROMPTSxINPUTxOUTPUT@CONCURRENCY."),
        long: str = typer.Option("32x64x3000@32", help="long workload: PROMPTSxINPUTxOUTPUT@CONCURRENCY."),
        out: Optional[Path] = typer.Option(None, help="Write the JSON here too."),
        plot: Optional[Path] = typer.Option(None, help="Write a PNG bar chart here."),
        workdir: Path = typer.Option(Path("artifacts/bench-serve"), help="Server logs and configs."),
        client_nice: Optional[int] = typer.Option(None, "--client-nice", help=CLIENT_NICE_HELP),
    ) -> None:
        """vLLM's serving benchmark against stock vLLM, Ray Serve LLM and kvtier (tier full, and auto
        routing) on the same engine settings; prints JSON (tok/s, TTFT, TPOT, preemptions, failed, serving
        CPU per 1k tokens, ratios to stock, and for kvtier's arms where the first token's time goes)."""
        from kvtier.benchmarks.serve import Workload, run_serve_bench
        from kvtier.benchmarks.serve_plot import plot as draw

        cfg, settings = engine_settings(config, kv_cache_bytes, max_num_seqs, max_model_len, dtype=dtype)
        specs = {"idle": idle, "short": short, "long": long}
        chosen = {}
        for w in workloads.split(","):
            try:
                counts, conc = specs[w].split("@")
                p, i, o = (int(x) for x in counts.split("x"))
                chosen[w] = Workload(prompts=p, input_len=i, output_len=o, concurrency=int(conc))
            except (KeyError, ValueError):
                raise typer.BadParameter(f"workload {w!r}: expected idle|short|long as PROMPTSxINPUTxOUTPUT@CONCURRENCY") from None
        bad = set(arms.split(",")) - {"stock", "rayllm", "full", "auto"}
        if bad:
            raise typer.BadParameter(f"unknown arms {sorted(bad)}", param_hint="--arms")
        check_client_nice(client_nice)
        result = run_serve_bench(settings, cfg.model_dump(mode="json"), chosen, arms.split(","), runs, workdir,
                                 log=lambda m: typer.echo(m, err=True), client_nice=client_nice)
        emit(result, out, plot, draw)
