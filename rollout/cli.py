"""`kvtier rollout` commands."""

from __future__ import annotations

from typing import Optional

import typer

rollout_app = typer.Typer(no_args_is_help=True, help="verl rollouts on the compressed engine (rollout.name=kvtier).")


@rollout_app.command("demo")
def demo(
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the tiny Qwen3, built if missing)."),
    budget: Optional[int] = typer.Option(64, help="K per KV head; 0 = full attention."),
    buffer: int = typer.Option(16, help="r: protected recent tokens and round cadence."),
    policy: str = typer.Option("random", help="Eviction policy."),
    batch_size: int = typer.Option(4, help="Prompts in the DataProto batch."),
    response_length: int = typer.Option(256, help="Tokens generated per sample (tiny model never stops early)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy)."),
    kv_cache_mb: int = typer.Option(64, help="KV pool size in MiB."),
) -> None:
    """Generate a batch of rollouts through verl's agent loop on the kvtier backend; print per-sample stats."""
    from kvtier.rollout.demo import run_demo

    run_demo(model=model, budget=budget or None, buffer=buffer, policy=policy, batch_size=batch_size,
             response_length=response_length, temperature=temperature, kv_cache_bytes=kv_cache_mb << 20,
             echo=typer.echo)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to the `kvtier` CLI."""
    app.add_typer(rollout_app, name="rollout")
    from .rl_smoke import register as register_rl   # `kvtier rl smoke` (verl's trainer on kvtier rollouts)
    register_rl(app)
