"""`kvtier model export-checkpoint`: a training checkpoint becomes a model directory transformers loads with the
checkpoint's weights (bf16, as a finished training ships them), its shape, and EXPORT.json naming the step."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_checkpoint_exports_to_a_loadable_model_with_its_weights(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from kvtier.models.reasoner import reasoner_config
    from kvtier.models.reasoner_export import export_checkpoint
    from kvtier.models.train_config import TrainConfig

    torch.manual_seed(3)
    model = Qwen3ForCausalLM(reasoner_config("long-8kv")).eval()
    cfg = {**asdict(TrainConfig(family="chains-long", shape="long-8kv")), "dtype": "float32"}
    history = [{"step": 50, "loss": 1.0, "held_out_local": {"token_accuracy": 0.5, "trace_exact": 0.0}},
               {"step": 60, "loss": 0.9}]
    torch.save({"config": cfg, "model": model.state_dict(), "opt": {}, "step": 61, "history": history,
                "window": [], "elapsed": 1.0}, tmp_path / "ckpt.pt")
    rec = export_checkpoint(tmp_path / "ckpt.pt", tmp_path / "model")
    assert rec["step"] == 61 and rec["last_held_out"]["step"] == 50
    # a phase continued from the export nests its EXPORT.json (read before training: no crash at the end)
    from kvtier.models.reasoner_train import previous_record

    assert previous_record(tmp_path / "model") == {"exported_checkpoint": rec}
    (tmp_path / "model" / "TRAINING.json").write_text('{"steps": 7}')
    assert previous_record(tmp_path / "model") == {"steps": 7}
    assert previous_record(tmp_path) == {"model_dir": str(tmp_path), "record": None}
    assert json.loads((tmp_path / "model" / "EXPORT.json").read_text())["weights_sha256"] == rec["weights_sha256"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    assert loaded.config.num_key_value_heads == model.config.num_key_value_heads == 8
    ids = torch.tensor([[0, 5, 9, 14, 3, 7, 22, 4]])
    with torch.no_grad():
        for p in model.parameters():          # the export is bf16: compare against the same rounding
            p.copy_(p.to(torch.bfloat16).float())
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)


def test_a_long_shape_is_written_with_its_positions_in_the_tokenizer(tmp_path):
    """A long model's tokenizer says 4,096 (what transformers checks inputs against), the shipped shape's 2,048."""
    import json

    from transformers import Qwen3ForCausalLM

    from kvtier.models.reasoner import build_reasoner_tokenizer, reasoner_config
    from kvtier.models.reasoner_save import save_model

    for shape, positions in (("long-8kv", 4096), ("base", 2048)):
        save_model(Qwen3ForCausalLM(reasoner_config(shape)), build_reasoner_tokenizer(), tmp_path / shape)
        tok = json.loads((tmp_path / shape / "tokenizer_config.json").read_text())
        assert tok["model_max_length"] == positions, shape
