"""A trained reasoner as a model directory transformers, vLLM and verl load (a finished training's output,
reasoner_train.py, and an exported checkpoint's, reasoner_export.py): one writer, so both are byte-alike."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .reasoner import reasoner_config


def save_model(model, tok, out: Path) -> str:
    """Write config (the model's shape), generation config, bf16 safetensors and tokenizer; returns the
    weights' sha256."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    cfg = reasoner_config(like=model.config)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(out))
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0).save_pretrained(str(out))
    tok.model_max_length = model.config.max_position_embeddings   # a long shape's tokenizer says 4,096, not 2,048
    tok.save_pretrained(str(out))
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous().clone() for k, v in sorted(model.state_dict().items())
             if k != "lm_head.weight"}                                   # tied to embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        p = out / name
        if p.exists():
            p.write_text(json.dumps(json.loads(p.read_text()), indent=2, sort_keys=True) + "\n")
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
