"""A training checkpoint (`OUT/ckpt.pt`, written every `ckpt_every` steps and at a pause) as a model directory
transformers, vLLM and verl load: an earlier point of a training, e.g. an RL start whose reward has room both
ways (issue #38), or a phase's committed checkpoint from the git history. The weights, config, generation
config and tokenizer are written exactly as a finished training writes them (`reasoner_save.save_model`), with
EXPORT.json saying which checkpoint, at which step, and the training's last held-out record."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def export_checkpoint(ckpt: Path, out: Path) -> dict:
    """Write `ckpt`'s model to `out`; returns (and writes) EXPORT.json's dict."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    from .reasoner import build_reasoner_tokenizer, reasoner_config
    from .reasoner_save import save_model
    from .train_config import saved_config

    ckpt, out = Path(ckpt), Path(out)
    state = torch.load(ckpt, weights_only=False, map_location="cpu")
    cfg = saved_config(state["config"])
    if cfg.get("init_from"):       # a second phase keeps its first model's shape
        mcfg = reasoner_config(like=AutoConfig.from_pretrained(cfg["init_from"]))
    else:
        mcfg = reasoner_config(cfg["shape"])
    model = Qwen3ForCausalLM(mcfg)
    model.load_state_dict(state["model"])
    sha = save_model(model, build_reasoner_tokenizer(), out)
    evals = [h for h in state.get("history", []) if any(k.startswith("held_out") for k in h)]
    rec = {"source": str(ckpt), "source_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest(),
           "step": int(state["step"]), "config": cfg, "last_held_out": evals[-1] if evals else None,
           "weights_sha256": sha}
    (out / "EXPORT.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec
