"""Training recipes: the phases ``kvtier model train-recipe`` runs in order, each ``train-reasoner`` from the last.

``long`` is issue #36's one recipe for the long-chain reasoners (``long-2kv`` and ``long-8kv`` take the same
phases, steps and seeds). It follows the shipped reasoner's (docs/reasoner.md) with six full-attention phases:
a first phase at 2e-3; then short chains (more trace starts and low counters, where the first model's errors
were) with the boxed answer weighted 20x at 5e-4; then retrieval learned on the shorter `chains` family alone,
carried to the long traces at 3e-4 with 8 `chains` problems a step beside them (_RETRIEVAL says why), and
bridged to the needle's distance with a middle family (_BRIDGE); then the served-eviction fine-tune
(random at K = 256 / 512 / 1024, a quarter of samples at full attention, needle answers untrained under eviction:
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
# Retrieval, chosen 2026-12-05 from long-8kv's errors, before any run judging eviction on the long models (both
# shapes train it; docs/reasoner.md has the runs). After p2 every held-out error was a long-range retrieval at
# chance, teacher forced -- the restated question (?x or ?k, p ~0.5, copied from the prompt 2.5-3.9k tokens back)
# and the needle's key digits (p ~0.1, 1,600 tokens back) -- while every computed line was right. 525 steps with
# 8 problems a step of the shipped reasoner's shorter `chains` family beside the long ones (lr 3e-4) did not move
# them, on either family. The `chains` family alone (batch 16, 5e-4) did: a step change after ~250 steps, then
# 16/16 of both kinds held out. So p3 learns retrieval where the distances are short and the steps cheap (~2.5 s
# here), and p4 carries it to the long traces (p3 forgets the long counters, which it never sees) with 8 `chains`
# problems a step beside them so that it is kept. From p2 (no mixed steps before) 600 such steps stayed on the
# plateau (loss 0.021-0.022 throughout, held-out retrieval at chance): p3b, 900 more at a fresh 5e-4, continues
# the same stage (added before it ran).
_RETRIEVAL = {"family": "chains", "batch": 16, "short_batch": 0, "answer_weight": 20.0}
_KEEP_RETRIEVAL = {"aux_family": "chains", "aux_batch": 8}
# The bridge, chosen 2026-12-05 before p4's last read (the rule: p4's held-out chains-long local and needle
# traces both >= 0.95 teacher forced, or this phase). p4 carried the question's retrieval to 2.5-3.9k tokens but the needle's copy
# of the key line's second digit, 1,605 tokens back, only left chance late (long-8kv: 18/32 held-out needles
# right at step 1,500). The copy head works at `chains`' 675 tokens; p5 adds a rung between, `chains-mid`
# (training only: key 1,105 tokens back), beside the long traces. The evaluated tasks are unchanged.
_BRIDGE = {"aux_family": "chains-mid", "aux_batch": 8}

RECIPES: dict[str, dict] = {
    "long": {
        "family": "chains-long",
        "dtype": "bfloat16",
        "phases": (
            Phase("p1", {"steps": 2000}),
            Phase("p2", {"steps": 1000, "seed": 17, "lr": 5e-4, "warmup": 20, **_LATER}),
            Phase("p3", {"steps": 600, "seed": 18, "lr": 5e-4, "warmup": 20, **_RETRIEVAL}),
            Phase("p3b", {"steps": 900, "seed": 20, "lr": 5e-4, "warmup": 20, **_RETRIEVAL}),
            Phase("p4", {"steps": 1500, "seed": 19, "lr": 3e-4, "warmup": 50, **_LATER, **_KEEP_RETRIEVAL}),
            Phase("p5", {"steps": 1000, "seed": 21, "lr": 3e-4, "warmup": 50, **_LATER, **_BRIDGE}),
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
        params = {"family": r["family"], "dtype": r["dtype"], **ph.params}     # a phase may train another family
        out.append((ph.name, d, TrainConfig(shape=shape, init_from=prev, device=device, workers=workers,
                                            attention=attention, **params)))
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
