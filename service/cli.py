"""The `kvtier` command line (typer). Subcommands import their modules lazily so `kvtier --help` is fast
and a command that needs vLLM or Ray only imports them when it runs."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtier: LLM serving and RL rollouts under a bounded KV cache.")
model_app = typer.Typer(no_args_is_help=True, help="Build the local models kvtier uses.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print JSON).")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")


@model_app.command("tiny")
def model_tiny(
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face model into."),
    seed: int = typer.Option(0, help="Weight and tokenizer seed; same seed, same bytes."),
) -> None:
    """A deterministic tiny Qwen3 (random weights, locally trained tokenizer) in HF format."""
    from kvtier.models.tiny import build_tiny_model

    path = build_tiny_model(out, seed=seed)
    typer.echo(f"tiny Qwen3 written to {path}")


# Each command group lives with the code it drives; a module exposes register(app) and imports its heavy
# dependencies (torch, vLLM, Ray, verl) only inside the commands.
COMMAND_MODULES = (
    "kvtier.benchmarks.cli",     # kvtier bench rounds|throughput|capacity|compaction
    "kvtier.benchmarks.serve_cli",  # kvtier bench serve
    "kvtier.engine.cli",         # kvtier generate
    "kvtier.service.serve_cli",  # kvtier serve
    "kvtier.rollout.cli",        # kvtier rollout ...
    "kvtier.evaluation.cli",     # kvtier eval ...
    "kvtier.observability.cli",  # kvtier dashboards export|push
    "kvtier.service.k8s_config",  # kvtier k8s serve-config
)


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app, bench_app)


_register_commands()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
