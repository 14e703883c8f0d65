"""`kvtier bench goodput`: correct answers per second through the service vs stock vLLM (goodput.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .serve_cli import CLIENT_NICE_HELP, check_client_nice, emit, engine_settings

# The demo config (the shipped reasoner and its tiers). `auto`: a pool of POOL_TRACES full traces of the
# family's TRACE_TOKENS in the engine's dtype (chains: 8 MiB in bfloat16 at 2 KiB per token, 16 MiB in
# float32), so full attention is KV-bound at concurrency 32 whatever dtype `auto` picks on this machine.
# chains-long: 4,096 tokens (32 blocks of 128), the long models' positions; its longest sequence is 3,943.
DEFAULT_KV = "auto"
POOL_TRACES = 4
TRACE_TOKENS = {"chains": 1024, "chains-long": 4096}


def trace_tokens(family: str | None) -> int:
    """Tokens per full trace in the `auto` pool (a JSONL's: chains')."""
    return TRACE_TOKENS.get(family or "chains", TRACE_TOKENS["chains"])


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("goodput")
    def bench_goodput(
        tasks: str = typer.Option("reasoner", help="reasoner (its held-out problems, both kinds in equal numbers, or --kinds) "
                                  "or a JSONL of {prompt, answer[, kind, id]} graded by the \\boxed{} grader."),
        family: Optional[str] = typer.Option(None, help="With --tasks reasoner: the task family, chains or "
                                             "chains-long (2.5-4k-token traces: a --config whose model and "
                                             "max_model_len hold 4,096 tokens); default: the one the config's "
                                             "model records (its TRAINING.json or EXPORT.json), else chains."),
        kinds: Optional[str] = typer.Option(None, help="With --tasks reasoner: comma-separated task kinds, local "
                                            "and/or needle (default both, in equal numbers; local alone: the "
                                            "local-chain workload)."),
        arms: str = typer.Option("stock,full,auto", help="Comma-separated: stock, full, auto, or tier names."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", help="Service YAML with one engine "
                                              "(default: src/kvtier/configs/reasoner.yaml)."),
        problems: int = typer.Option(64, help="Problems per kind (reasoner) or the first 2x this many lines (0: all)."),
        concurrency: str = typer.Option("32", help="Requests in flight (vLLM's benchmark --max-concurrency); "
                                        "several (1,4,16,64): every arm at every load, JSON under `loads`."),
        kv_bytes: str = typer.Option(DEFAULT_KV, "--kv-bytes", help="Every engine's KV pool (auto: "
                                     f"{POOL_TRACES} full traces in the engine's dtype: {TRACE_TOKENS} tokens each)."),
        max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Override (default: the config's, `auto` resolved)."),
        max_tokens: Optional[int] = typer.Option(None, help="Per request; requests stop at EOS (default: the family's "
                                                 "budget, chains 1200 (longest trace 1,122), chains-long 4000; "
                                                 "a JSONL 1200)."),
        runs: int = typer.Option(1, help="Repeat every arm (ratios per run; the top-level arms are the median run)."),
        seed: int = typer.Option(0),
        client_nice: Optional[int] = typer.Option(None, "--client-nice", help=CLIENT_NICE_HELP),
        out: Optional[Path] = typer.Option(None, help="Write the JSON here too."),
        plot: Optional[Path] = typer.Option(None, help="Write the accuracy vs correct-answers-per-second PNG here."),
        workdir: Path = typer.Option(Path("artifacts/bench-goodput"), help="Server logs, configs, the prompt file."),
    ) -> None:
        """Graded problems through stock vLLM and kvtier's tiers, greedy, stopping at EOS; prints JSON
        (accuracy per kind with CI vs full, correct answers/s, tok/s, output lengths, TTFT, latency,
        preemptions, eviction events, failed; ratios to stock)."""
        from kvtier.service.config import DEFAULT_CONFIG

        from kvtier.models.reasoner import models_family
        from kvtier.tasks.chains import KINDS, family as task_family

        from .goodput import load_tasks, plot as draw, run_goodput
        from .goodput_load import plot_loads, run_goodput_loads

        try:
            loads = [int(c) for c in concurrency.split(",") if c.strip()]
            if not loads or min(loads) < 1:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(f"{concurrency!r}: one or more positive integers, e.g. 32 or 1,4,16,64",
                                     param_hint="--concurrency") from None

        default = DEFAULT_CONFIG.with_name("reasoner.yaml")
        cfg, settings = engine_settings(config, None if kv_bytes == "auto" else kv_bytes, max_num_seqs, None, default=default)
        fam = None
        if tasks == "reasoner":
            try:
                fam = task_family(models_family(family, [settings.model_path]))
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--family") from None
        else:
            for name, given in (("--family", family), ("--kinds", kinds)):
                if given is not None:
                    raise typer.BadParameter("chooses the reasoner's problems; --tasks is a JSONL here", param_hint=name)
        chosen_kinds = None if kinds is None else tuple(k.strip() for k in kinds.split(",") if k.strip())
        if chosen_kinds is not None and (not chosen_kinds or set(chosen_kinds) - set(KINDS)
                                         or len(set(chosen_kinds)) < len(chosen_kinds)):
            raise typer.BadParameter(f"{kinds!r}: one or more of {', '.join(KINDS)}, each once", param_hint="--kinds")
        max_tokens = max_tokens or (fam.max_tokens if fam else 1200)
        if kv_bytes == "auto":
            from kvtier.service.sizing import DTYPE_BYTES, kv_bytes_per_token

            pool = POOL_TRACES * trace_tokens(fam.name if fam else None) * kv_bytes_per_token(settings.model_path, DTYPE_BYTES[settings.dtype])
            cfg, settings = engine_settings(config, str(pool), max_num_seqs, None, default=default)
        chosen = [a.strip() for a in arms.split(",") if a.strip()]
        known = {"stock", "full", "auto", *(t.name for t in cfg.tiers)}
        bad = [a for a in chosen if a not in known]
        if bad:
            raise typer.BadParameter(f"unknown arms {bad}; known: {sorted(known)}", param_hint="--arms")
        if fam is not None and settings.max_model_len < max_tokens + 64:
            raise typer.BadParameter(f"task family {fam.name} needs max_model_len >= {max_tokens + 64} (prompt + "
                                     f"max_tokens {max_tokens}); the config's engine has {settings.max_model_len}: "
                                     "raise its max_model_len, or pass --config with a model trained for it",
                                     param_hint="--family")
        try:
            graded = load_tasks(tasks, problems, fam.name if fam else "chains", chosen_kinds)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--tasks") from None
        check_client_nice(client_nice)
        log = lambda m: typer.echo(m, err=True)  # noqa: E731
        if len(loads) > 1:
            result = run_goodput_loads(settings, cfg.model_dump(mode="json"), graded, chosen, runs, workdir, loads,
                                       max_tokens, seed, log=log, family=fam.name if fam else None,
                                       client_nice=client_nice)
            emit(result, out, plot, plot_loads)
            return
        result = run_goodput(settings, cfg.model_dump(mode="json"), graded, chosen, runs, workdir, loads[0],
                             max_tokens, seed, log=log, family=fam.name if fam else None, client_nice=client_nice)
        emit(result, out, plot, draw)

    @bench_app.command("goodput-merge")
    def bench_goodput_merge(
        results: list[Path] = typer.Argument(..., help="`bench goodput` JSON files, single-load or load sweeps, "
                                             "made with the same settings, problems, loads and arms."),
        out: Optional[Path] = typer.Option(None, help="Write the merged JSON here too."),
        plot: Optional[Path] = typer.Option(None, help="Write its plot here."),
    ) -> None:
        """Runs made one at a time as one result, as if made with --runs N (the median run chosen again;
        each run's commit and machine kept)."""
        import json

        from .goodput import plot as draw
        from .goodput_load import plot_loads
        from .goodput_merge import merge

        try:
            merged = merge([json.loads(p.read_text()) for p in results])
        except (OSError, ValueError, KeyError) as exc:
            raise typer.BadParameter(str(exc), param_hint="RESULTS") from None
        emit(merged, out, plot, plot_loads if "loads" in merged else draw)

