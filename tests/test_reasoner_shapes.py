"""The long-chain reasoner's shapes (issue #36 item 3): `train-reasoner --shape long-2kv|long-8kv` builds
models that hold chains-long's sequences, long-8kv with real models' 8 KV heads at (nearly) long-2kv's
parameters; the shape is recorded and refused by name when unknown."""

import json

import pytest

from kvtier.models.reasoner import SHAPES, reasoner_config


def _params(shape):
    from transformers import Qwen3ForCausalLM

    return sum(p.numel() for p in Qwen3ForCausalLM(reasoner_config(shape)).parameters())


def test_long_shapes_hold_the_long_family_and_8kv_keeps_the_parameters():
    from kvtier.models.reasoner_data import longest_sequence
    from kvtier.tasks.chains import family

    long = longest_sequence(family("chains-long"))
    assert reasoner_config("base").max_position_embeddings < long            # why the long shapes exist
    two, eight = reasoner_config("long-2kv"), reasoner_config("long-8kv")
    assert two.max_position_embeddings >= long and eight.max_position_embeddings >= long
    assert (two.num_key_value_heads, eight.num_key_value_heads) == (2, 8) and eight.head_dim >= 32
    assert abs(_params("long-8kv") / _params("long-2kv") - 1) <= 0.10
    kv = lambda c: c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2    # noqa: E731  K+V values/token
    assert kv(eight) == 2 * kv(two)           # head_dim 32 is vLLM CPU attention's smallest: 2x, said in SHAPES
    assert _params("base") == _params("long-2kv")


def test_unknown_shape_is_refused_by_name():
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, ["model", "train-reasoner", "--shape", "huge", "--out", "/nonexistent/never"])
    assert r.exit_code == 2 and "--shape" in r.output and "long-8kv" in r.output, r.output
    with pytest.raises(ValueError, match="huge"):
        reasoner_config("huge")


def test_chains_long_needs_a_long_shape_and_trains_with_one(tmp_path):
    from kvtier.models.reasoner_train import train
    from kvtier.models.train_config import TrainConfig

    with pytest.raises(ValueError, match="--shape base"):
        train(TrainConfig(steps=1, batch=1, family="chains-long", dtype="float32", threads=1), tmp_path / "base",
              log=lambda s: None)
    rec = train(TrainConfig(steps=1, batch=1, family="chains-long", shape="long-8kv", dtype="float32", threads=1,
                            held_out=1, eval_every=1000, ckpt_every=1000), tmp_path / "l8", log=lambda s: None)
    cfg = json.loads((tmp_path / "l8" / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["max_position_embeddings"]) == (8, 4096)
    assert json.loads((tmp_path / "l8" / "TRAINING.json").read_text())["config"]["shape"] == "long-8kv"
    assert rec
