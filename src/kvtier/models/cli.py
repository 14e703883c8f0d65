"""`kvtier model ...`: build the local models kvtier uses."""

from __future__ import annotations

from pathlib import Path

import typer

model_app = typer.Typer(no_args_is_help=True, help="Build the local models kvtier uses.")


@model_app.command("tiny")
def model_tiny(
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face model into."),
    seed: int = typer.Option(0, help="Weight and tokenizer seed; same seed, same bytes."),
) -> None:
    """A deterministic tiny Qwen3 (random weights, locally trained tokenizer) in HF format."""
    from .tiny import build_tiny_model

    path = build_tiny_model(out, seed=seed)
    typer.echo(f"tiny Qwen3 written to {path}")


def register(app: typer.Typer) -> None:
    """Add `kvtier model` to the `kvtier` CLI."""
    from .reasoner_cli import register as register_reasoner   # kvtier model train-reasoner

    register_reasoner(model_app)
    app.add_typer(model_app, name="model")


if __name__ == "__main__":   # `python -m kvtier.models.cli ...`: where only torch, transformers and typer are (a GPU box)
    from kvtier.models.reasoner_cli import register as register_reasoner_commands

    register_reasoner_commands(model_app)
    model_app()
