"""The `kvtier` command line (typer): `kvtier ...` or `python -m kvtier.cli ...`.

Each package registers the commands it implements (a `cli` module with `register(app)`); this module only
assembles them. Commands import their heavy dependencies (torch, vLLM, Ray, verl) when they run, so
`kvtier --help` is fast."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvtier: LLM serving and RL rollouts under a bounded KV cache.")

COMMAND_MODULES = (
    "kvtier.models.cli",         # kvtier model tiny
    "kvtier.benchmarks.cli",     # kvtier bench rounds|compaction|throughput|rollout|capacity|table10|serve
    "kvtier.engine.cli",         # kvtier generate, kvtier calibrate (TriAttention; code in policies/)
    "kvtier.service.cli",        # kvtier serve, kvtier k8s serve-config
    "kvtier.rollout.cli",        # kvtier rollout demo, kvtier rl smoke
    "kvtier.evaluation.cli",     # kvtier eval ...
    "kvtier.observability.cli",  # kvtier dashboards export|push
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
