"""`kvtier bench rl` (GRPO arms through verl's trainer, rl.py) and `kvtier bench rl-table` (its tables, rl_table.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("rl")
    def bench_rl(
        steps: int = typer.Option(12, help="GRPO steps per arm."),
        arms: str = typer.Option("full,dense,replay", help="full (no eviction), dense (eviction at K, learner sees "
                                 "everything, token TIS), dense-rs (dense + verl's sequence rejection at --rejection), replay (eviction at K, learner under each sample's eviction), "
                                 "replay-fullref (replay, reference policy at full attention), replay-share (replay, "
                                 "--full-share of each group at full attention), replay-anchor (both), vllm (verl's own vLLM rollout, "
                                 "full attention)."),
        seeds: int = typer.Option(1, help="Runs per arm (seed s: verl's data order); held-out accuracy per seed and "
                                  "pooled."),
        full_share: float = typer.Option(0.25, "--full-share", help="replay-share / replay-anchor: share of each "
                                         "GRPO group generated at full attention."),
        kl_coef: Optional[float] = typer.Option(None, "--kl-coef", help="actor.kl_loss_coef in every arm (default: "
                                                "kvtier_grpo.yaml's 0.001)."),
        budget: int = typer.Option(256, help="K of the compressed arms."),
        buffer: int = typer.Option(32),
        batch_size: int = typer.Option(4, "--batch-size", help="Prompts per step."),
        n: int = typer.Option(4, help="GRPO group size."),
        lr: float = typer.Option(1e-5),
        kv_cache_mb: Optional[int] = typer.Option(None, "--kv-cache-mb", help="KV pool per arm, MiB (equal memory; "
                                                  "default: 4 full traces of --response-length in the rollout dtype, "
                                                  "so the full arm is KV-bound)."),
        heldout: int = typer.Option(32, help="Held-out local-chain problems per evaluation."),
        family: str = typer.Option("chains", help="Task family (kvtier.tasks.chains): chains (the shipped reasoner's) "
                                   "or chains-long (2.5-4k-token traces; a --model with >= 4,096 positions)."),
        response_length: Optional[int] = typer.Option(None, "--response-length", help="Response tokens (default: "
                                                      "1160 for chains, whose longest trace is 1,122; the family's "
                                                      "budget otherwise, chains-long 4000)."),
        rejection: Optional[str] = typer.Option(None, help="verl rollout_rs of the dense-rs arm, OPTION:THRESHOLD "
                                                "(e.g. seq_mean_k3:0.2; the dense arm's steps report seq_k3 tails)."),
        rollout_dtype: str = typer.Option("auto", "--rollout-dtype", help="The rollout engine's dtype, auto | float32 | bfloat16 | "
                                          "float16 (auto: float32 on a CPU without AVX512-BF16/AMX, verl's "
                                          "bfloat16 elsewhere)."),
        learner_dtype: str = typer.Option("fp32", help="The actor's compute dtype (fp32; bf16, verl's default, is "
                                          "emulated on CPUs without native bf16: ~25x slower backward; "
                                          "the first run, 2026-12-02 in results/HISTORY.md, ran bf16)."),
        temperature: float = typer.Option(1.0, help="The rollout's sampling temperature (verl's default 1.0; choose it "
                                          "on the selection set, `kvtier eval reasoner --split selection`)."),
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Samples per learner forward (default: "
                                                  "the step's whole batch; 4k-token traces need fewer)."),
        model: Optional[str] = typer.Option(None, help="Start checkpoint (default: the shipped reasoner)."),
        workdir: Path = typer.Option(Path("artifacts/bench-rl"), help="Runs, checkpoints and evaluations."),
        out: Optional[Path] = typer.Option(None, help="Also write the JSON here (rewritten after each run: a partial report while it runs)."),
        plot: Optional[str] = typer.Option(None, help="Write the PNG here."),
        supervised: Optional[str] = typer.Option(None, "--supervised", help="A supervised model read beside the arms "
                                                 "on the same held-out problems, with its TRAINING.json's cost (e.g. "
                                                 "src/kvtier/models/reasoner_long, the start's eviction fine-tune)."),
        kept_only: bool = typer.Option(False, "--kept-only", help="Train nothing: report the runs already kept in "
                                       "--workdir and list the others under `missing` (an unfinished series)."),
    ) -> None:
        """GRPO through verl's trainer from one checkpoint per arm: reward and held-out accuracy (evicted and
        full) vs step and wall-clock, rollout seconds, learner/sampler ratio tails (src/kvtier/benchmarks/rl.py)."""
        from kvtier.benchmarks.rl import RLBenchShape, check_bench, run_rl_bench
        from kvtier.models.reasoner import reasoner_dir
        from kvtier.tasks.chains import family as task_family

        try:
            fam = task_family(family)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--family") from None
        if response_length is None:
            response_length = RLBenchShape.response_length if fam.name == "chains" else fam.max_tokens
        shape = RLBenchShape(steps=steps, batch_size=batch_size, n=n, budget=budget, buffer=buffer, lr=lr,
                             kv_cache_mb=kv_cache_mb, heldout=heldout, rejection=rejection, learner_dtype=learner_dtype,
                             family=fam.name, response_length=response_length, seeds=seeds, full_share=full_share,
                             kl_coef=kl_coef, rollout_dtype=rollout_dtype, temperature=temperature,
                             micro_batch=micro_batch)
        try:
            check_bench(shape, arms.split(","))
        except ValueError as exc:                     # an unknown arm or dtype; dense-rs without --rejection
            raise typer.BadParameter(str(exc)) from None
        try:
            report = run_rl_bench(str(Path(model or reasoner_dir()).resolve()), shape, arms.split(","),
                                  workdir.resolve(), plot, echo=typer.echo, out=out, kept_only=kept_only,
                                  supervised=str(Path(supervised).resolve()) if supervised else None)
        except ValueError as exc:                     # --kept-only and no start evaluation kept for these settings
            if not kept_only:
                raise
            raise typer.BadParameter(str(exc), param_hint="--kept-only") from None
        typer.echo(json.dumps(report, indent=2))


    @bench_app.command("rl-export")
    def bench_rl_export(
        workdir: Path = typer.Option(..., help="A `kvtier bench rl` workdir holding the arm's finished runs."),
        out: Path = typer.Option(..., help="The model directory to write (with EXPORT.json and service.yaml)."),
        arm: str = typer.Option("replay"),
        seed: Optional[int] = typer.Option(None, help="Default: the run that ended best (held-out evicted, then "
                                           "full accuracy, then the lower seed)."),
    ) -> None:
        """A run's end policy as a model directory `make serve`'s config serves (src/kvtier/benchmarks/rl_export.py):
        `kvtier bench goodput -c OUT/service.yaml` measures it."""
        from kvtier.benchmarks.rl_export import export_run

        try:
            meta = export_run(workdir, arm, out, seed)
        except (ValueError, FileNotFoundError) as exc:
            raise typer.BadParameter(str(exc)) from None
        typer.echo(json.dumps({k: meta[k] for k in ("arm", "seed", "chosen_by", "model_id", "heldout")}, indent=1))

    @bench_app.command("rl-table")
    def bench_rl_table(report: Path = typer.Argument(..., help="A `kvtier bench rl` JSON (--out).")) -> None:
        """The report's tables as Markdown: per arm pooled over seeds (reward, held-out end and change vs start with
        CIs, rollout speed-up, learner/sampler KL, rejected samples), then per seed (src/kvtier/benchmarks/rl_table.py)."""
        from kvtier.benchmarks.rl_table import arm_table, seed_table, start_line, supervised_line

        try:
            data = json.loads(report.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"{report}: {exc}", param_hint="REPORT") from None
        typer.echo("\n\n".join(part for part in (start_line(data), supervised_line(data), arm_table(data),
                                                   seed_table(data)) if part))
