"""The reasoner's task family for RL (#24): a verl dataset and a rule reward.

* `write_dataset(dir, train=N, val=M[, family=])`: seeded parquet files in verl's RLHFDataset format, from
  `kvtier.tasks.chains` (the family by name: `chains`, the shipped reasoner's, or `chains-long`). The
  held-out split is the evaluation's own problems (`eval_problems`, the ones the README's accuracy is
  measured on); the train split comes from another seed and never contains one of them.
* `compute_score`: verl's custom reward (`reward.custom_reward_function.path=<this file>`,
  `name=compute_score`): 1.0 when the response's last ``\\boxed{}`` equals the gold answer exactly (the
  chains' answers are two digits), else 0.0.

The reasoner has no chat template and verl's agent loop applies one to every prompt, so a run sets
``data.apply_chat_template_kwargs.chat_template`` to `PROMPT_ONLY`, which renders the user message as it
is, after the BOS token: the prompt's token ids are then exactly the plain completion prompt's (tested).
"""

from __future__ import annotations

from pathlib import Path

from kvtier.tasks.boxed import extract_final_boxed
from kvtier.tasks.chains import DEFAULT_FAMILY, KINDS, TRAIN_SEED, ChainProblem, family as task_family

DATA_SOURCE = "kvtier_chains"
PROMPT_ONLY = "{{ bos_token }}{{ messages[-1].content }}"   # no quotes: it travels as a Hydra override
RL_SEED = TRAIN_SEED + 24   # the train split's seed: not the supervised training's stream, not the eval's


def row(problem: ChainProblem, index: int, split: str, family: str = DEFAULT_FAMILY) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": problem.prompt}],
            "ability": f"{family}-{problem.kind}", "reward_model": {"style": "rule", "ground_truth": problem.answer},
            "extra_info": {"index": index, "split": split, "kind": problem.kind, "n": problem.n}}


def write_dataset(directory: str | Path, *, train: int, val: int, kinds: tuple[str, ...] = ("local",),
                  seed: int = RL_SEED, family: str = DEFAULT_FAMILY) -> tuple[Path, Path]:
    """(train.parquet, val.parquet) under `directory`: per kind of the task family `family`, `train` problems
    from `seed` and the first `val` held-out evaluation problems, interleaved by kind."""
    import pandas as pd

    fam = task_family(family)                 # ValueError naming the known families
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds must be among {KINDS}, got {bad}")
    held_out = {kind: fam.eval_problems(val, kind) for kind in kinds}
    seen = {(p.kind, p.y0, p.x0, p.n) for ps in held_out.values() for p in ps}
    train_rows, val_rows = [], []
    for kind in kinds:
        drawn = [p for p in fam.problems(seed, 2 * train, kind) if (p.kind, p.y0, p.x0, p.n) not in seen][:train]
        train_rows += [(i, p) for i, p in enumerate(drawn)]
        val_rows += [(i, p) for i, p in enumerate(held_out[kind])]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "train.parquet", directory / "val.parquet"
    for path, rows, split in ((paths[0], train_rows, "train"), (paths[1], val_rows, "val")):
        ordered = sorted(rows, key=lambda ip: (ip[0], ip[1].kind))   # kinds interleaved
        pd.DataFrame([row(p, k, split, fam.name) for k, (_, p) in enumerate(ordered)]).to_parquet(path)
    return paths


def compute_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl's custom reward: 1.0 if the response's last boxed answer is the gold answer, else 0.0."""
    answer = extract_final_boxed(solution_str or "")
    return float(answer is not None and ground_truth is not None and answer == str(ground_truth))
