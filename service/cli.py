"""The `kvtier` command line (typer). Subcommands import their modules lazily so `kvtier --help` is fast
and a command that needs vLLM or Ray only imports them when it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtier: LLM serving and RL rollouts under a bounded KV cache.")
model_app = typer.Typer(no_args_is_help=True, help="Build the local models kvtier uses.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print JSON).")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False))


@model_app.command("tiny")
def model_tiny(
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face model into."),
    seed: int = typer.Option(0, help="Weight and tokenizer seed; same seed, same bytes."),
) -> None:
    """A deterministic tiny Qwen3 (random weights, locally trained tokenizer) in HF format."""
    from kvtier.models.tiny import build_tiny_model

    path = build_tiny_model(out, seed=seed)
    typer.echo(f"tiny Qwen3 written to {path}")


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
) -> None:
    """Milliseconds per eviction round for every policy, plus the full-gather compaction floor."""
    from kvtier.benchmarks.rounds import RoundShapes, run_rounds_bench

    shapes = RoundShapes(layers=layers, kv_heads=kv_heads, head_dim=head_dim, budget=budget, buffer=buffer,
                         query_heads=query_heads, prompt_len=prompt_len, batch=batch)
    names = policies.split(",") if policies else None
    _print_json(run_rounds_bench(shapes, device=device, repeats=repeats, policies=names))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
