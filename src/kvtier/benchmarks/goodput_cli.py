"""`kvtier bench goodput`: correct answers per second through the service vs stock vLLM (goodput.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .serve_cli import emit, engine_settings

# The demo config (the shipped reasoner and its tiers); 8 MiB holds about 4 of its full traces
# (2 KiB per token, ~1,050 tokens each): full attention is KV-bound at concurrency 32.
DEFAULT_KV = "8MiB"


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("goodput")
    def bench_goodput(
        tasks: str = typer.Option("reasoner", help="reasoner (its held-out problems, both kinds in equal numbers) "
                                  "or a JSONL of {prompt, answer[, kind, id]} graded by the \\boxed{} grader."),
        arms: str = typer.Option("stock,full,auto", help="Comma-separated: stock, full, auto, or tier names."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", help="Service YAML with one engine "
                                              "(default: src/kvtier/configs/reasoner.yaml)."),
        problems: int = typer.Option(64, help="Problems per kind (reasoner) or the first 2x this many lines (0: all)."),
        concurrency: int = typer.Option(32, help="Requests in flight (vLLM's benchmark --max-concurrency)."),
        kv_bytes: str = typer.Option(DEFAULT_KV, "--kv-bytes", help="Every engine's KV pool."),
        max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Override (default: the config's, `auto` resolved)."),
        max_tokens: int = typer.Option(1200, help="Per request; requests stop at EOS (the reasoner's longest trace is 1,122)."),
        runs: int = typer.Option(1, help="Repeat every arm (ratios per run; the top-level arms are the median run)."),
        seed: int = typer.Option(0),
        out: Optional[Path] = typer.Option(None, help="Write the JSON here too."),
        plot: Optional[Path] = typer.Option(None, help="Write the accuracy vs correct-answers-per-second PNG here."),
        workdir: Path = typer.Option(Path("artifacts/bench-goodput"), help="Server logs, configs, the prompt file."),
    ) -> None:
        """Graded problems through stock vLLM and kvtier's tiers, greedy, stopping at EOS; prints JSON
        (accuracy per kind with CI vs full, correct answers/s, tok/s, output lengths, TTFT, latency,
        preemptions, eviction events, failed; ratios to stock)."""
        from kvtier.service.config import DEFAULT_CONFIG

        from .goodput import load_tasks, plot as draw, run_goodput

        cfg, settings = engine_settings(config, kv_bytes, max_num_seqs, None, default=DEFAULT_CONFIG.with_name("reasoner.yaml"))
        chosen = [a.strip() for a in arms.split(",") if a.strip()]
        known = {"stock", "full", "auto", *(t.name for t in cfg.tiers)}
        bad = [a for a in chosen if a not in known]
        if bad:
            raise typer.BadParameter(f"unknown arms {bad}; known: {sorted(known)}", param_hint="--arms")
        try:
            graded = load_tasks(tasks, problems)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--tasks") from None
        result = run_goodput(settings, cfg.model_dump(mode="json"), graded, chosen, runs, workdir, concurrency,
                             max_tokens, seed, log=lambda m: typer.echo(m, err=True))
        emit(result, out, plot, draw)
