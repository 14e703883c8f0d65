"""`kvtier bench ...` commands."""

from __future__ import annotations

import json
from typing import Optional

import typer


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2))


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
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
