"""A deterministic tiny Qwen3 built entirely offline.

``build_tiny_model(out, seed)`` writes a Hugging Face model directory that both
``transformers`` and vLLM load as a standard ``Qwen3ForCausalLM``:

* ``config.json`` / ``generation_config.json``: 4 layers, hidden 512, 8 query
  heads, 2 KV heads, head_dim 64, MLP 1024, 4096 positions, bfloat16.
* ``model.safetensors``: seeded random weights (bfloat16).
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: a
  byte-level BPE tokenizer trained locally on a generated corpus
  (:mod:`kvtier.models.tiny_corpus`), with the Qwen special tokens
  ``<|endoftext|>`` (pad/bos), ``<|im_start|>`` and ``<|im_end|>`` (eos) and a
  ChatML chat template.

Same seed, same bytes: every file is byte-identical across builds.  The seed
drives the weights; the tokenizer corpus is fixed (seeded with a constant), so
every tiny model shares one vocabulary and models built with different seeds
are interchangeable at the token level.

The model is random, so its text is gibberish; what matters is that it has the
right *shape* (GQA with 2 KV heads, head_dim 64) and that greedy decoding
produces varied tokens.  The ``lm_head`` rows of special and reserved tokens
are zero, so a random model practically never emits ``<|im_end|>`` or
``<|endoftext|>`` and generations run to ``max_tokens`` (handy for long-decode
KV-cache benchmarks).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .tiny_corpus import IM_END, IM_START, tiny_corpus

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "MARKER",
    "TINY_CONFIG",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_tiny_model_dir",
    "ensure_tiny_model",
    "tiny_corpus",
]

# Written last by build_tiny_model; its presence means the directory is complete.
MARKER = "kvtier_tiny_model.json"
# Bump when the construction changes, so ensure_tiny_model rebuilds stale caches.
BUILD_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Tokenizer size (specials + 256 byte symbols + merges).  A multiple of 64, so the
# embedding matrix has no rows without a token (which vLLM could sample).
TOKENIZER_VOCAB = 4096

TINY_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
)

# Std of the seeded normal init.  Embeddings and lm_head use 0.02; the projection
# matrices inside the blocks are scaled up (std = GAIN / sqrt(fan_in)) so that the
# blocks actually mix context into the residual stream instead of the next token
# being a pure function of the current one.
EMBED_STD = 0.02
BLOCK_GAIN = 1.0

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# --------------------------------------------------------------------------- tokenizer


def build_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """Train the byte-level BPE tokenizer; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    # Fill any shortfall (the corpus ran out of merges) with reserved special tokens,
    # so the tokenizer size is exactly vocab_size (a multiple of 64).
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size()

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="left",
    )


# --------------------------------------------------------------------------- model


def _round_up(n: int, k: int = 64) -> int:
    return (n + k - 1) // k * k


def _init_weights(model, seed: int, special_ids: list[int]) -> None:
    """Seeded, explicit init (independent of transformers' own _init_weights)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif p.dim() == 2 and ("embed_tokens" in name or name.startswith("lm_head")):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * EMBED_STD)
            elif p.dim() == 2:
                std = BLOCK_GAIN / p.shape[1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            elif p.dim() == 1:  # biases (none in Qwen3, kept for safety)
                p.zero_()
            else:  # pragma: no cover - Qwen3 has no other parameter shapes
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
        lm_head = model.get_output_embeddings().weight
        lm_head[special_ids] = 0.0


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _normalize_json(path: Path) -> None:
    """Rewrite a JSON file with sorted keys so key order can never vary."""
    _write_json(path, json.loads(path.read_text(encoding="utf-8")))


def build_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3 (weights from ``seed``) as a HF model directory; returns its path.

    Deterministic: the same seed gives byte-identical files.  Existing files in
    ``out`` with the same names are overwritten; the marker file is written last.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)

    # Tokenizer.
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (out / name).exists():
            _normalize_json(out / name)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # Special + reserved tokens: their lm_head rows are zeroed below.
    special_ids = sorted(
        set(ids.values()) | {i for t, i in tokenizer.get_vocab().items() if t.startswith("<|reserved_")}
    )

    # Config.
    config = Qwen3Config(
        vocab_size=_round_up(len(tokenizer)),
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        dtype="bfloat16",
        **TINY_CONFIG,
    )
    config.architectures = ["Qwen3ForCausalLM"]

    # Weights: build in fp32, init explicitly from the seed, cast to bf16.
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    _init_weights(model, seed, special_ids)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16

    config.save_pretrained(str(out))
    _normalize_json(out / "config.json")
    gen_cfg = GenerationConfig(
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=[ids[IM_END], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )
    gen_cfg.save_pretrained(str(out))
    _normalize_json(out / "generation_config.json")

    # safetensors (sorted names, fixed metadata, contiguous bf16 tensors).
    state = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for p in out.iterdir():
        if p.is_file():
            p.chmod(0o644)  # safetensors writes 0600; keep the directory uniformly readable

    # Marker last: a deterministic manifest of the files it vouches for.
    manifest = {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.iterdir())
            if p.is_file() and p.name != MARKER
        },
    }
    _write_json(out / MARKER, manifest)
    return out


# --------------------------------------------------------------------------- cache


def default_tiny_model_dir(seed: int = 0) -> Path:
    """``$KVTIER_TINY_MODEL`` if set, else ``<repo>/artifacts/tiny-qwen3``.

    For a non-zero seed the directory name gets a ``-seed<N>`` suffix, so models of
    different seeds never overwrite each other.
    """
    env = os.environ.get("KVTIER_TINY_MODEL")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "artifacts" / "tiny-qwen3"
    return base if seed == 0 else base.with_name(f"{base.name}-seed{seed}")


def _is_complete(path: Path, seed: int) -> bool:
    try:
        manifest = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return manifest.get("build_version") == BUILD_VERSION and manifest.get("seed") == seed


def ensure_tiny_model(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return a built tiny model directory, building it only if missing or incomplete.

    ``cache_dir`` is the model directory itself (default: :func:`default_tiny_model_dir`).
    The build goes to a temporary sibling directory that is renamed into place, so
    concurrent callers never see a half-written model.
    """
    path = Path(cache_dir) if cache_dir is not None else default_tiny_model_dir(seed)
    if _is_complete(path, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        build_tiny_model(tmp, seed=seed)
        if _is_complete(path, seed):  # someone else finished first
            return path
        if path.exists():
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError:
            if not _is_complete(path, seed):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
