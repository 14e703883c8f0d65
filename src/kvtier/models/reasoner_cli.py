"""`kvtier model train-reasoner`: train the shipped reasoner (src/kvtier/models/reasoner_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(model_app: typer.Typer) -> None:
    """Add `train-reasoner` and `export-checkpoint` to the `kvtier model` group (src/kvtier/models/cli.py calls
    it)."""
    from kvtier.tasks.chains import FAMILIES, family as task_family

    from .reasoner import REASONER_DIR
    from .train_config import ATTENTION, DTYPES, TrainConfig

    d = TrainConfig()

    def one_of(value: str, choices: tuple, hint: str) -> None:
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=hint)

    @model_app.command("train-reasoner")
    def train_reasoner(
        out: Path = typer.Option(REASONER_DIR, help="Model directory (default: the shipped src/kvtier/models/reasoner)."),
        steps: int = typer.Option(d.steps),
        seed: int = typer.Option(d.seed, help="Data and init seed."),
        batch: int = typer.Option(d.batch, help="Sequences per step (~1,000 tokens each)."),
        lr: float = typer.Option(d.lr),
        threads: int = typer.Option(d.threads, help="torch CPU threads (the weights depend on it)."),
        dtype: str = typer.Option(d.dtype, help=f"Matmul precision, {'|'.join(DTYPES)} (the weights depend on it): "
                                  "auto = bfloat16 autocast on CUDA and on CPUs with AVX512-BF16 or AMX, float32 "
                                  "elsewhere (torch emulates bf16 there). TRAINING.json records the resolved dtype, "
                                  "why, and the steps per second."),
        family: str = typer.Option(d.family, help=f"Task family: {', '.join(FAMILIES)} (kvtier.tasks.chains)."),
        shape: str = typer.Option(d.shape, help="Model shape (kvtier.models.reasoner.SHAPES): base (the shipped "
                                  "reasoners'), long-2kv, long-8kv (4,096 positions; 2 or 8 KV heads per layer)."),
        init_from: str = typer.Option(d.init_from, help="Continue from this trained model directory (a second phase)."),
        short_batch: int = typer.Option(d.short_batch, help="Extra short local chains per step (12-40 lines)."),
        aux_family: str = typer.Option(d.aux_family, help="With --aux-batch: another task family whose problems join "
                                       "every step (e.g. chains: retrieval at its shorter distances)."),
        aux_batch: int = typer.Option(d.aux_batch, help="Extra problems per step from --aux-family (half local, half "
                                      "needle; its held-out problems excluded)."),
        warmup: int = typer.Option(d.warmup),
        answer_weight: float = typer.Option(d.answer_weight, help="Loss weight of the boxed answer's tokens."),
        evict: str = typer.Option(d.evict, help="Train under simulated eviction, POLICY:K[,K...][:r] (e.g. "
                                  "random:128,256,512:32, random_line_reserve:256,512,1024:32; "
                                  "src/kvtier/models/train_eviction.py). '': full attention."),
        full_share: float = typer.Option(d.full_share, help="With --evict: share of samples under full attention."),
        device: str = typer.Option(d.device, help="cpu or cuda[:i] (torch only; a checkpoint resumes on either)."),
        workers: int = typer.Option(d.workers, help="With --evict: processes simulating evictions ahead of the steps "
                                    "(keeps a GPU fed; 0: inline, which a policy that reads keys needs)."),
        attention: str = typer.Option(d.attention, help="With --evict: death-time attention, auto | mask (SDPA with a "
                                      "boolean mask) | flex (FlexAttention; auto's choice on CUDA)."),
    ) -> None:
        """Deterministic CPU training (resumes from OUT/ckpt.pt); writes the model, tokenizer, TRAINING.json.
        Steps per second in each precision: --steps 24 --dtype float32 and --dtype bfloat16, each with its own
        scratch --out (TRAINING.json's `speed`; docs/reasoner.md)."""
        one_of(attention, ATTENTION, "--attention")
        one_of(dtype, DTYPES, "--dtype")
        for hint, name in (("--family", family), ("--aux-family", aux_family if aux_batch else family)):
            try:
                task_family(name)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=hint) from None
        from .reasoner import SHAPES

        if shape not in SHAPES:
            raise typer.BadParameter(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}", param_hint="--shape")
        from .reasoner_train import train

        rec = train(TrainConfig(steps=steps, seed=seed, batch=batch, lr=lr, threads=threads,
                                dtype=dtype, family=family, shape=shape, device=device, workers=workers, attention=attention, init_from=init_from, short_batch=short_batch, warmup=warmup,
                                aux_family=aux_family, aux_batch=aux_batch,
                                answer_weight=answer_weight, evict=evict, full_share=full_share), out,
                    log=lambda s: typer.echo(s))
        typer.echo(json.dumps({k: v for k, v in rec.items() if k != "loss_curve"}, indent=1))

    @model_app.command("train-recipe")
    def train_recipe(
        shape: str = typer.Option(..., help="Model shape (kvtier.models.reasoner.SHAPES), e.g. long-2kv, long-8kv."),
        work: Path = typer.Option(..., help="Phase directories go here (WORK/<phase>/, each a model directory)."),
        recipe: str = typer.Option("long", help="kvtier.models.reasoner_recipe.RECIPES: the phases, steps and seeds."),
        device: str = typer.Option("cpu", help="cpu or cuda[:i]."),
        workers: int = typer.Option(0, help="Eviction phases: processes simulating evictions ahead of the steps."),
        through: str = typer.Option("", help="Stop after this phase ('': all)."),
        attention: str = typer.Option("auto", help="Eviction phases: death-time attention, auto | mask (SDPA with a "
                                      "boolean mask) | flex (FlexAttention; auto's choice on CUDA)."),
    ) -> None:
        """Run a recipe's phases in order, each from the last; finished phases are skipped, a paused one resumes
        (same command), on any device. The long-chain reasoners: --recipe long (docs/reasoner.md)."""
        from .reasoner import SHAPES
        from .reasoner_recipe import check_recipe, run_recipe

        if shape not in SHAPES:
            raise typer.BadParameter(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}", param_hint="--shape")
        one_of(attention, ATTENTION, "--attention")
        try:
            check_recipe(recipe, through)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--recipe/--through") from None
        res = run_recipe(recipe, shape, work, device, workers, through, log=lambda s: typer.echo(s), attention=attention)
        typer.echo(json.dumps(res))

    @model_app.command("export-checkpoint")
    def export_checkpoint_cmd(
        ckpt: Path = typer.Argument(..., help="A training checkpoint (OUT/ckpt.pt of train-reasoner)."),
        out: Path = typer.Option(..., help="Model directory to write (config, weights, tokenizer, EXPORT.json)."),
    ) -> None:
        """An earlier point of a training as a model directory (e.g. an RL start with room to learn)."""
        if not ckpt.is_file():
            raise typer.BadParameter(f"{ckpt} is not a file", param_hint="CKPT")
        from .reasoner_export import export_checkpoint

        rec = export_checkpoint(ckpt, out)
        typer.echo(json.dumps({k: rec[k] for k in ("source", "step", "last_held_out", "weights_sha256")}, indent=1))
