"""Training recipes: the phases ``kvtier model train-recipe`` runs in order, each ``train-reasoner`` from the last.

``long`` is issue #36's one recipe for the long-chain reasoners (``long-2kv`` and ``long-8kv`` take the same
phases, steps and seeds). It is the shipped reasoner's (docs/reasoner.md) at the same 4,500 full-attention
steps in three phases instead of six, since the task already restates the start and the question: a first
phase at 2e-3; then short chains (more trace starts and low counters, where the first model's errors were)
with the boxed answer weighted 20x, at 5e-4 and then 3e-4, the last with 8 problems a step of the shorter
`chains` family beside (_RETRIEVAL says why); then the served-eviction fine-tune (random at K =
256 / 512 / 1024, a quarter of samples at full attention, needle answers untrained under eviction:
train_eviction.py). bf16 autocast (weights and optimizer fp32), the shipped reasoner's precision: a GPU and a
CPU with AVX512-BF16/AMX compute it natively; chosen before the first step of this recipe, when an H200 was lent
(an earlier float32 start of long-8kv on a 2-core CPU, 1,296 steps, is superseded: docs/reasoner.md).

Each phase writes WORK/<phase>/ (model files and TRAINING.json, which nests the phases before it); a phase
with a TRAINING.json is skipped, a phase with a ckpt.pt resumes, and a paused phase (SIGTERM/SIGINT) ends the
run: the same command continues it, on this device or another (TRAINING.json's ``devices`` says which steps ran
where).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Phase:
    name: str
    params: dict = field(default_factory=dict)   # TrainConfig fields; init_from is the phase before


_LATER = {"short_batch": 16, "answer_weight": 20.0}
# p3 adds 8 problems a step of the shipped reasoner's family (`chains`: the key ~680 tokens before the answer,
# the question ~1,000): after long-8kv's p2 every held-out error was a retrieval, at chance, teacher forced --
# the restated question (?x or ?k, p ~0.5; copied from the prompt 2.5-3.9k tokens back) and the needle's key
# digits (p ~0.15; 1,600 tokens back) -- while every computed line was right; 1,000 steps at answer weight 20
# had not moved them. The shipped reasoner learned both at its shorter distances; the matching it learns there
# is by content, which the long traces' positions (all trained) let carry. Chosen 2026-12-05 from long-8kv's p2
# errors (docs/reasoner.md), before any run judging eviction on the long models; both shapes train it.
_RETRIEVAL = {"aux_family": "chains", "aux_batch": 8}

RECIPES: dict[str, dict] = {
    "long": {
        "family": "chains-long",
        "dtype": "bfloat16",
        "phases": (
            Phase("p1", {"steps": 2000}),
            Phase("p2", {"steps": 1000, "seed": 17, "lr": 5e-4, "warmup": 20, **_LATER}),
            Phase("p3", {"steps": 1500, "seed": 18, "lr": 3e-4, "warmup": 50, **_LATER, **_RETRIEVAL}),
            Phase("evict", {"steps": 800, "seed": 31, "lr": 3e-4, "warmup": 50, **_LATER,
                            "evict": "random:256,512,1024:32", "full_share": 0.25}),
        ),
    },
}


def phase_configs(recipe: str, shape: str, work: Path, device: str = "cpu", workers: int = 0, attention: str = "auto"):
    """[(phase name, out dir, TrainConfig)] of `recipe` for `shape` under `work`, each continuing the last."""
    from .train_config import TrainConfig

    check_recipe(recipe)
    r = RECIPES[recipe]
    out, prev = [], ""
    for ph in r["phases"]:
        d = Path(work) / ph.name
        out.append((ph.name, d, TrainConfig(family=r["family"], dtype=r["dtype"], shape=shape, init_from=prev,
                                            device=device, workers=workers, attention=attention, **ph.params)))
        prev = str(d)
    return out


def check_recipe(recipe: str, through: str = "") -> None:
    """ValueError naming the setting for an unknown recipe or a `through` that is none of its phases."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    names = [ph.name for ph in RECIPES[recipe]["phases"]]
    if through and through not in names:
        raise ValueError(f"--through {through!r} is not a phase of {recipe!r}: {', '.join(names)}")


def run_recipe(recipe: str, shape: str, work: Path, device: str = "cpu", workers: int = 0, through: str = "",
               log=print, train=None, attention: str = "auto") -> dict:
    """Run the recipe's phases not yet done (through phase `through`, '' = all). Returns {"done": [names]};
    when a phase paused, {"done": [...], "paused": name, "at": step}; when a pause was asked for as a phase
    finished, {"done": [...], "stopped_after": name}. `train`: a test's stand-in."""
    if train is None:
        from .reasoner_train import train
    check_recipe(recipe, through)
    phases = phase_configs(recipe, shape, work, device, workers, attention)
    done = []
    for name, out, cfg in phases:
        if (out / "TRAINING.json").exists():
            log(f"{name}: done ({out})")
        else:
            log(f"{name}: training into {out}")
            rec = train(cfg, out, log)
            if "paused_at" in rec:
                return {"done": done, "paused": name, "at": rec["paused_at"]}
            if rec.get("stop_requested"):             # asked to pause as the phase finished: start no other
                return {"done": [*done, name], "stopped_after": name}
        done.append(name)
        if name == through:
            break
    return {"done": done}
