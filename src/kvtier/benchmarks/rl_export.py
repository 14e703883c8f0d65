"""A `kvtier bench rl` run's end policy as a model directory `make serve`'s config serves (issue #59 item 6).

`best_seed` picks the run by a rule fixed before the series ends: the highest held-out accuracy under eviction
at its end, then the highest at full attention, then the lowest seed. `export_run` writes that run's final
Hugging Face checkpoint (verl's `global_step_<steps>/actor/huggingface`) as a reasoner directory with the one
writer every reasoner goes through (`reasoner_save.save_model`: bf16 weights, config, tokenizer), EXPORT.json
(the run's settings, held-out reads and weights' hash) and `service.yaml`: src/kvtier/configs/reasoner.yaml with
only the model and its id changed, so `kvtier serve -c` / `kvtier bench goodput -c` serve it as `make serve`
serves the shipped one.
"""

from __future__ import annotations

import json
from pathlib import Path

from .rl_store import read_kept

SERVE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "reasoner.yaml"


def kept_runs(workdir: Path, arm: str) -> dict[int, dict]:
    """{seed: {"key", "run"}} of the finished runs of `arm` kept in `workdir`."""
    out = {}
    for path in sorted((workdir / arm).glob("seed*.json")):
        kept = read_kept(path)
        if kept and path.stem[4:].isdigit():
            out[int(path.stem[4:])] = kept
    return out


def best_seed(runs: dict[int, dict]) -> int:
    """The seed whose run ended best: held-out evicted accuracy, then full, then the lower seed."""
    if not runs:
        raise ValueError("no finished run to export")

    def rank(seed: int):
        end = runs[seed]["run"]["heldout"]["end"]
        return (-end["evicted"]["accuracy"], -end["full"]["accuracy"], seed)

    return min(runs, key=rank)


def export_run(workdir: Path, arm: str, out: Path, seed: int | None = None) -> dict:
    """Write the run's end policy to `out` (a model directory plus service.yaml); returns EXPORT.json's dict."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtier.models.reasoner_save import save_model

    from .rl import hf_checkpoint

    runs = kept_runs(Path(workdir), arm)
    keys = [r["key"] for r in runs.values()]
    differing = sorted({k for key in keys for k in key if any(other.get(k) != key[k] for other in keys)})
    if seed is None and differing:
        raise ValueError(f"the kept runs of {arm} in {workdir} ran with different {', '.join(differing)}: the best "
                         "of them is no series' best; pass --seed")
    seed = best_seed(runs) if seed is None else seed
    if seed not in runs:
        raise ValueError(f"no finished run of {arm} seed {seed} in {workdir} (kept: {sorted(runs)})")
    key, run = runs[seed]["key"], runs[seed]["run"]
    hf = hf_checkpoint(Path(workdir) / arm / f"seed{seed}", key["steps"], key["model"])
    # the learner's checkpoint names kvtier's replay attention (registered only inside the trainer): the weights
    # are what is exported, and the served config is the reasoner's own
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="sdpa")
    sha = save_model(model, AutoTokenizer.from_pretrained(str(hf)), Path(out))
    name = f"kvtier-rl-{arm}-seed{seed}"
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    (engine,) = cfg["engines"].values()          # the demo config has one engine
    engine.update(model=".", model_id=name)       # the directory service.yaml sits in: the export can move
    (Path(out) / "service.yaml").write_text(f"# {SERVE_CONFIG.name} with {name}'s weights (kvtier bench rl-export)\n"
                                            + yaml.safe_dump(cfg, sort_keys=False))
    meta = {"from": "kvtier bench rl", "workdir": str(workdir), "arm": arm, "seed": seed,
            "chosen_by": "best_seed" if seed == best_seed(runs) else "given", "settings": key,
            "heldout": run["heldout"], "train_seconds": run.get("train_seconds"), "checkpoint": str(hf),
            "model_id": name, "model_safetensors_sha256": sha}
    (Path(out) / "EXPORT.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
