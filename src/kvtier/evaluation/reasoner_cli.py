"""`kvtier eval reasoner`: the shipped reasoner's accuracy under eviction (src/kvtier/evaluation/reasoner_eval.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from kvtier.models.reasoner import models_family

from .cli_common import POLICIES_HELP, csv_list as _csv, policy_items


def model_labels(paths: list[str]) -> list[str]:
    """Each model's label in side-by-side results: the shortest path suffix that tells it from the others
    (`train/long-2kv/p5`, `train/long-8kv/p5` -> `long-2kv/p5`, `long-8kv/p5`; one model: its folder name)."""
    parts = [Path(p).resolve().parts for p in paths]
    if len(set(parts)) < len(parts):
        raise ValueError(f"the same model twice ({paths})")
    for k in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(ps[-k:]) for ps in parts]
        if len(set(labels)) == len(labels):
            return labels
    raise AssertionError("distinct resolved paths have distinct suffixes")


def register(eval_app: typer.Typer) -> None:
    """Add `reasoner` to the `kvtier eval` group."""

    @eval_app.command("reasoner")
    def eval_reasoner(
        quick: bool = typer.Option(False, "--quick", help="The CI grid: 16 problems per kind, 1 run, "
                                   "full/random/streaming at K=128,512 (a few minutes on 2 CPU cores)."),
        out: Path = typer.Option(Path("artifacts/reasoner-eval"), help="Output directory (instances, tables, JSON, plot)."),
        model: Optional[str] = typer.Option(None, help="Model directory (default: the shipped src/kvtier/models/reasoner)."),
        problems: Optional[int] = typer.Option(None, help="Held-out problems per kind (default 32; quick 16)."),
        runs: Optional[int] = typer.Option(None, help="R paired seeds per problem (default 2; quick 1)."),
        policies: Optional[str] = typer.Option(None, help=f"{POLICIES_HELP} Default random,snapkv,rkv,h2o,streaming."),
        budgets: Optional[str] = typer.Option(None, help="Comma-separated K (default 128,256,512)."),
        kinds: Optional[str] = typer.Option(None, help="Comma-separated task kinds (default local,needle)."),
        family: Optional[str] = typer.Option(None, help="Task family (kvtier.tasks.chains): chains (the shipped "
                                             "reasoner's) or chains-long (2.5-4k-token traces; needs a model with "
                                             ">= 4,096 positions); default: the one the model was trained on (its "
                                             "TRAINING.json). Sets max_tokens and max_model_len."),
        buffer: int = typer.Option(32, help="r: recent buffer and round cadence."),
        temperature: float = typer.Option(0.0, help="0: greedy (the R paired seeds drive random's draws)."),
        top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling at temperature > 0 (verl's rollout: 1.0)."),
        split: str = typer.Option("heldout", help="heldout (the evaluation's problems) or selection (a disjoint set "
                                  "for choosing settings before the runs that judge them, e.g. an RL budget and "
                                  "temperature)."),
        seed: int = typer.Option(0),
        threads: int = typer.Option(1, help="torch CPU threads."),
        dtype: str = typer.Option("auto", help="Engine dtype: auto (float32 on a CPU without AVX512-BF16/AMX, "
                                  "where bf16 matmuls are emulated; else bfloat16), bfloat16, float32."),
        engine: str = typer.Option("vllm", help="vllm (the served engine) or reference (kvtier.reference: transformers "
                                   "with the same schedule and keep-sets; runs where vLLM is not, e.g. a GPU box)."),
        device: str = typer.Option("", help="--engine reference: cuda or cpu (default: cuda when there is one)."),
        max_batch: int = typer.Option(0, help="--engine reference: requests decoded together (0: all)."),
    ) -> None:
        """Full, random, snapkv, rkv, h2o, streaming x K on both task kinds; prints JSON, writes report.md
        (every pairwise comparison: paired problem-clustered bootstrap CI + sign test) and the plot.
        Policies with parameters: --policies random,rkv,random_reserve:reserve=0.05,random_reserve:reserve=0.1."""
        from kvtier.models.reasoner import reasoner_dir

        from .reasoner_eval import QUICK, ReasonerEvalConfig, check_positions, markdown_table, run_reasoner_eval

        try:
            family = models_family(family, [model or str(reasoner_dir())])
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--family") from None
        kw = dict(QUICK) if quick else {}
        for name, val in (("problems", problems), ("runs", runs)):
            if val is not None:
                kw[name] = val
        if policies:
            kw["policies"] = tuple(policy_items(policies))
        if budgets:
            kw["budgets"] = tuple(int(b) for b in _csv(budgets))
        if kinds:
            kw["kinds"] = tuple(_csv(kinds))
        try:
            cfg = ReasonerEvalConfig(buffer=buffer, temperature=temperature, top_p=top_p, seed=seed, threads=threads,
                                     model=model or "", family=family, dtype=dtype, engine=engine, device=device, split=split,
                                     max_batch=max_batch, **kw)
        except ValueError as exc:
            hint = next((f"--{f}" for f in ("engine", "split") if str(exc).startswith(f)), "--dtype")
            raise typer.BadParameter(str(exc), param_hint=hint) from None
        try:
            check_positions(cfg)             # before any engine: the model must hold the family's traces
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--family") from None
        result = run_reasoner_eval(cfg, out)
        typer.echo(markdown_table(result))
        typer.echo((out / "report.md").read_text())
        typer.echo(json.dumps({k: result[k] for k in ("full_accuracy", "cells", "seconds", "config")}, indent=1))

    @eval_app.command("attention-profile")
    def eval_attention_profile(
        model: Optional[str] = typer.Option(None, help="Model directory (default: the shipped src/kvtier/models/reasoner)."),
        problems: int = typer.Option(16, help="Held-out local chains (gold traces, teacher forced)."),
        buffer: int = typer.Option(32, help="r: mass on keys more than r positions back is what eviction can take."),
        out: Optional[Path] = typer.Option(None, help="Write the JSON here too."),
    ) -> None:
        """Per head, under full attention on gold traces: attention share older than r, effective number of
        keys exp(entropy), prompt share (src/kvtier/evaluation/attention_profile.py)."""
        from kvtier.models.reasoner import reasoner_dir

        from .attention_profile import attention_profile

        res = attention_profile(model or str(reasoner_dir()), problems, buffer)
        text = json.dumps(res, indent=1)
        typer.echo(text)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")

    @eval_app.command("trace-errors")
    def eval_trace_errors(
        model: Optional[str] = typer.Option(None, help="Model directory (default: the shipped src/kvtier/models/reasoner)."),
        family: Optional[str] = typer.Option(None, help="Task family (chains, chains-long; default: the one the model was trained on (its TRAINING.json))."),
        kinds: str = typer.Option("local,needle", help="Comma-separated task kinds."),
        problems: int = typer.Option(16, help="Held-out problems per kind (gold traces, teacher forced)."),
        bf16: bool = typer.Option(False, "--bf16", help="Under bf16 autocast (how the long recipe trains)."),
        out: Optional[Path] = typer.Option(None, help="Write the JSON here too."),
    ) -> None:
        """Every teacher-forced mistake on gold held-out traces, by field (question, answer, key line, start,
        line) with the gold token's probability (src/kvtier/evaluation/trace_errors.py)."""
        from kvtier.models.reasoner import reasoner_dir
        from kvtier.tasks.chains import KINDS

        from .trace_errors import trace_errors

        chosen = tuple(_csv(kinds))
        try:
            family = models_family(family, [model or str(reasoner_dir())])
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--family") from None
        if not chosen or set(chosen) - set(KINDS):
            raise typer.BadParameter(f"{kinds!r}: one or more of {', '.join(KINDS)}", param_hint="--kinds")
        res = trace_errors(model or str(reasoner_dir()), family, chosen, problems, bf16)
        text = json.dumps(res, indent=1)
        typer.echo(json.dumps(res["per_kind"], indent=1))
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")

    @eval_app.command("probe-heads")
    def eval_probe_heads(
        model: Optional[List[str]] = typer.Option(None, help="Model directory, repeatable: models side by side "
                                                  "(default: the shipped src/kvtier/models/reasoner)."),
        family: Optional[str] = typer.Option(None, help="Task family of the needles (chains, chains-long; "
                                             "default: the one the models were trained on)."),
        n: int = typer.Option(32, help="Held-out needle problems."),
        budget: int = typer.Option(512, help="K of the random eviction around the key line."),
        buffer: int = typer.Option(32, help="r: recent buffer and round cadence."),
        heads: Optional[str] = typer.Option(None, help="Comma-separated numbers of KV heads per layer that keep the "
                                            "key line (default every count 0..H; 0 and H are always run)."),
        seed: int = typer.Option(0),
        threads: int = typer.Option(2, help="torch CPU threads."),
        out: Path = typer.Option(Path("artifacts/probe-heads"), help="Writes key_line.json, key_line.md, key_line.png."),
    ) -> None:
        """Needle retrieval against the number of KV heads that keep the key line (the seed paper's §5.2,
        Figure 3a's shape, on the reasoner's needle task; src/kvtier/evaluation/probes/key_line.py)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvtier.deathtime import ATTN_NAME, register
        from kvtier.models.reasoner import reasoner_dir

        from .probes.key_line import format_key_line, run_key_line_probe
        from .reasoner_plot import plot_key_line

        paths = model or [str(reasoner_dir())]
        try:
            family = models_family(family, paths)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--family") from None
        try:
            counts = [int(h) for h in _csv(heads)] if heads else None
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--heads") from None
        torch.set_num_threads(threads)
        register()
        try:
            labels = model_labels(paths)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        results = {}
        for label, path in zip(labels, paths):
            lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTN_NAME).eval()
            try:
                res = run_key_line_probe(lm, AutoTokenizer.from_pretrained(path), family=family, heads=counts, n=n,
                                         budget=budget, buffer=buffer, seed=seed, log=typer.echo)
            except ValueError as exc:                   # names the setting: heads out of range, or the budget
                raise typer.BadParameter(str(exc)) from None
            results[label] = {**res, "model": path}
        out.mkdir(parents=True, exist_ok=True)
        (out / "key_line.json").write_text(json.dumps({"results": results}, indent=1) + "\n")
        table = "\n".join(f"{name}: {format_key_line(res)}" for name, res in results.items())
        (out / "key_line.md").write_text(table)
        plot_key_line(results, out / "key_line.png")
        typer.echo(table)


if __name__ == "__main__":   # `python -m kvtier.evaluation.reasoner_cli reasoner ...`: where vLLM is not (a GPU box, --engine reference)
    _app = typer.Typer(no_args_is_help=True, add_completion=False)
    register(_app)
    _app()
