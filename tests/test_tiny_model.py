"""The deterministic tiny Qwen3 (kvtier.models.tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.models import tiny
from kvtier.models.tiny import MARKER, build_tiny_model, ensure_tiny_model


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_a"), seed=0)


def test_same_seed_is_byte_identical(tiny_dir, tmp_path):
    other = build_tiny_model(tmp_path / "tiny_b", seed=0)
    a, b = _files(tiny_dir), _files(other)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER} <= set(a)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{name} differs between two builds with the same seed"


def test_different_seed_gives_different_weights(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    other = build_tiny_model(tmp_path / "tiny_seed1", seed=1)
    wa = load_file(str(tiny_dir / "model.safetensors"))
    wb = load_file(str(other / "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    assert not (wa["model.embed_tokens.weight"] == wb["model.embed_tokens.weight"]).all()
    assert not (wa["model.layers.0.self_attn.k_proj.weight"] == wb["model.layers.0.self_attn.k_proj.weight"]).all()
    # The tokenizer does not depend on the seed: models of any seed share the vocabulary.
    assert (tiny_dir / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_config_and_load(tiny_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    assert raw["model_type"] == "qwen3"
    assert raw.get("dtype", raw.get("torch_dtype")) == "bfloat16"

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert cfg.num_hidden_layers == 4
    assert cfg.num_key_value_heads == 2
    assert cfg.num_attention_heads == 8
    assert cfg.head_dim == 64
    assert cfg.hidden_size == 512
    assert cfg.max_position_embeddings == 4096

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert 2048 <= len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert tok.eos_token_id in gen["eos_token_id"] and gen["pad_token_id"] == tok.pad_token_id

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.shape == (cfg.vocab_size, 512)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 64, 512)


def test_greedy_generation_is_varied(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    enc = tok("Solve $3x + 5 = 20$, so the answer is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, enc.input_ids.shape[1]:].tolist()
    assert len(new) == 20
    assert len(set(new)) > 1, f"degenerate generation: {new}"
    assert all(0 <= t < len(tok) for t in new)


def test_tokenizer_roundtrip_and_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    s = "Let $x = 12$. Then \\boxed{42} is the answer!\n  Héllo wörld, ∑ 🙂 end."
    ids = tok.encode(s, add_special_tokens=False)
    assert len(ids) < len(s.encode())  # BPE actually merges
    assert tok.decode(ids) == s

    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>" in text and text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == im_start and tok.eos_token_id in ids


def test_ensure_tiny_model_builds_once(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "tiny-qwen3"
    path = ensure_tiny_model(target, seed=0)
    assert path == target and (path / MARKER).is_file() and (path / "model.safetensors").is_file()
    assert not [p for p in target.parent.iterdir() if p.name != target.name]  # no temp dirs left

    def boom(*a, **k):
        raise AssertionError("rebuilt although the marker is present")

    monkeypatch.setattr(tiny, "build_tiny_model", boom)
    assert ensure_tiny_model(target, seed=0) == target

    # Without the marker the directory counts as incomplete and is rebuilt.
    (target / MARKER).unlink()
    with pytest.raises(AssertionError, match="rebuilt"):
        ensure_tiny_model(target, seed=0)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTIER_TINY_MODEL", raising=False)
    assert tiny.default_tiny_model_dir() == Path(tiny.__file__).resolve().parents[3] / "artifacts" / "tiny-qwen3"
    monkeypatch.setenv("KVTIER_TINY_MODEL", str(tmp_path / "m"))
    assert tiny.default_tiny_model_dir() == tmp_path / "m"
    assert tiny.default_tiny_model_dir(seed=3) == tmp_path / "m-seed3"
