"""The shipped reasoner (issue #16): a small Qwen3 trained on kvtier's synthetic chain tasks.

Files under ``src/kvtier/models/reasoner/`` (a standard Hugging Face directory; transformers and vLLM load it as
``Qwen3ForCausalLM``): ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, tied
embeddings), ``tokenizer.json`` + ``tokenizer_config.json``, and ``TRAINING.json`` (data seed, steps,
sha256 of the weights, loss curve summary, held-out accuracy, wall time).

Tokenizer: one token per character of the task alphabet (digits, ``y x n k = ? }``, space, newline),
``\\boxed{`` as one token, ``<|endoftext|>`` (bos/pad) and ``<|im_end|>`` (eos); 32 ids in all, so the
embedding has no row without a token. Prompts start with bos; a trace ends with eos.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["REASONER_DIR", "REASONER_EVICT_DIR", "REASONER_LONG_DIR", "REASONER_CONFIG", "SHAPES", "SHIPPED", "VOCAB_SIZE",
           "build_reasoner_tokenizer", "models_family", "reasoner_config", "reasoner_dir",
           "recorded_family", "trained_family"]

REASONER_DIR = Path(__file__).resolve().parent / "reasoner"
# The same model fine-tuned under the random eviction it is served with (issue #23; its TRAINING.json
# nests the full-attention phases it started from): `make serve`'s demo model until 2026-12-06.
REASONER_EVICT_DIR = Path(__file__).resolve().parent / "reasoner_evict"
# The long-chain reasoner (issue #36): shape long-8kv (8 KV heads of 32, 4,096 positions) trained on
# chains-long at full attention (p1-p5), then under random eviction (train/long-8kv/evict; its TRAINING.json
# nests the phases before it): `make serve`'s demo model (docs/reasoner.md says why this one).
REASONER_LONG_DIR = Path(__file__).resolve().parent / "reasoner_long"
# The names a service config's `engines.<name>.model` may give for a shipped checkpoint.
SHIPPED = {"reasoner": REASONER_DIR, "reasoner-evict": REASONER_EVICT_DIR, "reasoner-long": REASONER_LONG_DIR}

BOS = "<|endoftext|>"
EOS = "<|im_end|>"
CHARS = list("0123456789") + list("yxnk=?} \n")
BOX = "\\boxed{"
VOCAB_SIZE = 32

REASONER_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    attention_bias=False,
    use_sliding_window=False,
    rope_theta=10000.0,
)


# Model shapes `train-reasoner --shape` builds (issue #36). `base`: the shipped reasoners'. The long-chain
# reasoner's two: both hold chains-long's sequences (up to 3,943 tokens) in 4,096 positions.
# * long-2kv: base with the positions, 2 KV heads of 64 (1,024 K+V values per token over 4 layers).
# * long-8kv: 8 KV heads per layer, as real models (Qwen3-4B) have: 8 query heads of 32, head_dim 32 the
#   smallest vLLM's CPU attention takes (its supported head sizes start at 32), so 2,048 K+V values per token
#   (2x long-2kv: at head_dim 32 nothing closer fits 8 heads). K/V projections grow by 2 x 128 x 128 per layer;
#   the MLP is trimmed from 512 to 432 so the parameters stay within 1% of long-2kv (1.18 M).
SHAPES = {
    "base": REASONER_CONFIG,
    "long-2kv": {**REASONER_CONFIG, "max_position_embeddings": 4096},
    "long-8kv": {**REASONER_CONFIG, "max_position_embeddings": 4096, "num_attention_heads": 8,
                 "num_key_value_heads": 8, "head_dim": 32, "intermediate_size": 432},
}


def reasoner_dir() -> Path:
    """The shipped checkpoint directory (in the repository)."""
    return REASONER_DIR


def recorded_family(model_dir) -> str | None:
    """The task family (kvtier.tasks.chains) a reasoner directory records it was trained on: TRAINING.json's
    ``family`` (a finished training), else EXPORT.json's ``config.family`` (``kvtier model export-checkpoint``);
    None where neither records one (not a reasoner of ours, or one that predates the field)."""
    import json

    d = Path(model_dir)
    for name, get in (("TRAINING.json", lambda r: r.get("family")),
                      ("EXPORT.json", lambda r: (r.get("config") or {}).get("family"))):
        try:
            found = get(json.loads((d / name).read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str) and found:
            return found
    return None


def trained_family(model_dir) -> str:
    """The family the commands that grade a reasoner's task default to: the recorded one, else ``chains``
    (the shipped ``reasoner`` and ``reasoner-evict`` predate the field)."""
    return recorded_family(model_dir) or "chains"


def models_family(family: str | None, paths) -> str:
    """The task family the commands that grade reasoners use: ``family`` (--family) checked, else the one the
    models at ``paths`` were trained on (trained_family). ValueError naming --family where the models differ
    or record a family this version does not know."""
    from kvtier.tasks.chains import family as task_family

    if family is not None:
        return task_family(family).name
    found = {str(p): trained_family(p) for p in paths}
    if len(set(found.values())) > 1:
        raise ValueError(f"the models were trained on different task families ({found}): pass --family")
    (path, name), *_ = found.items()
    try:
        return task_family(name).name
    except ValueError as exc:
        raise ValueError(f"{path} records training on {name!r}, a family this version does not know ({exc}): "
                         "pass --family") from None


def build_reasoner_tokenizer():
    """A transformers fast tokenizer: word-level over single characters (+ ``\\boxed{``), ids fixed.

    ids: 0 bos/pad, 1 eos, 2 ``\\boxed{``, 3.. the characters in CHARS order, then reserved tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {BOS: 0, EOS: 1, BOX: 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    for i in range(VOCAB_SIZE - len(vocab)):
        vocab[f"<|reserved_{i}|>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # One piece per character; "\boxed{" is an added token, matched before pre-tokenisation.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok.add_special_tokens([BOS, EOS] + [t for t in vocab if t.startswith("<|reserved_")])
    tok.add_tokens([BOX])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=BOS, unk_token=None,
        clean_up_tokenization_spaces=False, model_max_length=REASONER_CONFIG["max_position_embeddings"],
        padding_side="left")


def reasoner_config(shape: str = "base", like=None):
    """The Qwen3Config of the reasoner (fp32 for training; the shipped weights are bf16): a shape of SHAPES,
    or the shape of `like` (a model's config: a continued training keeps its model's shape)."""
    from transformers import Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown reasoner shape {shape!r}; known: {', '.join(SHAPES)}")
    fields = SHAPES[shape]
    if like is not None:    # transformers 5 keeps rope_theta inside rope_parameters
        rope = (getattr(like, "rope_parameters", None) or {}).get("rope_theta")
        fields = {k: getattr(like, k) if hasattr(like, k) else rope if k == "rope_theta" else v
                  for k, v in REASONER_CONFIG.items()}
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1, pad_token_id=0, **fields)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg
