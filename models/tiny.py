"""A deterministic tiny Qwen3 built entirely offline.

``build_tiny_model(out, seed)`` writes a Hugging Face model directory that both
``transformers`` and vLLM load as a standard ``Qwen3ForCausalLM``:

* ``config.json`` / ``generation_config.json``: 4 layers, hidden 512, 8 query
  heads, 2 KV heads, head_dim 64, MLP 1024, 4096 positions, bfloat16.
* ``model.safetensors``: seeded random weights (bfloat16).
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: a
  byte-level BPE tokenizer trained locally on a corpus generated here, with the
  Qwen special tokens ``<|endoftext|>`` (pad/bos), ``<|im_start|>`` and
  ``<|im_end|>`` (eos) and a ChatML chat template.

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
import random
import shutil
import tempfile
from pathlib import Path

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
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Tokenizer size (specials + 256 byte symbols + merges).  A multiple of 64, so the
# embedding matrix has no rows without a token (which vLLM could sample).
TOKENIZER_VOCAB = 4096
CORPUS_SEED = 1234  # fixed: the tokenizer does not depend on the weight seed

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

# --------------------------------------------------------------------------- corpus

_WORDS = """
the of and to in is that for it as with was on be by at this from or an are
which have not but all were when we there can one so if will more what about
each she how their other up out many then them these some would make like him
into time has look two write go see number way could people than first water
been call who oil its now find long down day did get come made may part over
new sound take only little work know place year live me back give most very
after thing our just name good sentence man think say great where help through
much before line right too mean old any same tell boy follow came want show also
around form three small set put end does another well large must big even such
because turn here why ask went men read need land different home us move try
kind hand picture again change off play spell air away animal house point page
letter mother answer found study still learn should world high every near add
food between own below country plant last school father keep tree never start
city earth eye light thought head under story saw left few while along might
close something seem next hard open example begin life always those both paper
together got group often run important until children side feet car mile night
walk white sea began grow took river four carry state once book hear stop
without second later miss idea enough eat face watch far real almost let above
girl sometimes mountain cut young talk soon list song being leave family
""".split()

_MATH_WORDS = """
let suppose assume consider compute find prove show solve evaluate simplify
therefore hence thus since because so then note observe recall given
integer integers real number numbers prime primes divisor divisors factor
sum product difference quotient remainder modulo square root cube power
function equation inequality polynomial root roots coefficient degree
triangle circle radius area perimeter angle side length point line plane
probability expected value sequence series term limit derivative integral
matrix vector determinant eigenvalue solution answer case cases step
""".split()

_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl pr st str th tr sh ch".split()
_NUCLEI = "a e i o u ai ea io ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """n distinct pronounceable pseudo-words (deterministic for a given rng state)."""
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < n:
        w = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 4))
        )
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


_NAMES = "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy".split()
_VARS = list("xyznmkabc")
_OPS = ["+", "-", "\\cdot", "\\times"]


def _num(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return str(rng.randint(0, 99))
    if r < 0.85:
        return str(rng.randint(100, 9999))
    return str(rng.randint(10_000, 10_000_000))


def _english_sentence(rng: random.Random, lexicon: list[str], cum: list[float]) -> str:
    n = rng.randint(5, 16)
    words = rng.choices(lexicon, cum_weights=cum, k=n)
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), _num(rng))
    s = " ".join(words)
    s = s[0].upper() + s[1:]
    return s + rng.choice([".", ".", ".", "?", "!", ","])


def _math_sentence(rng: random.Random) -> str:
    v = rng.choice(_VARS)
    a, b, c = rng.randint(2, 12), rng.randint(1, 50), rng.randint(1, 200)
    kind = rng.randrange(8)
    if kind == 0:
        return f"Let ${v} = {a}$. Then ${a}{v} + {b} = {a * a + b}$."
    if kind == 1:
        return f"Solve ${a}{v} + {b} = {a * c + b}$, so ${v} = {c}$ and the answer is $\\boxed{{{c}}}$."
    if kind == 2:
        return f"We compute $\\frac{{{a * b}}}{{{a}}} = {b}$ and ${b}^2 = {b * b}$."
    if kind == 3:
        op = rng.choice(_OPS)
        return f"Note that ${a} {op} {b}$ is {rng.choice(_MATH_WORDS)} {rng.choice(_MATH_WORDS)}."
    if kind == 4:
        return f"The sum $\\sum_{{{v}=1}}^{{{a}}} {v} = {a * (a + 1) // 2}$."
    if kind == 5:
        return f"Since $\\sqrt{{{c * c}}} = {c}$, we get $\\boxed{{{c}}}$."
    if kind == 6:
        return f"Therefore ${v} \\equiv {b % a} \\pmod{{{a}}}$."
    words = [rng.choice(_MATH_WORDS) for _ in range(rng.randint(4, 10))]
    s = " ".join(words)
    return s[0].upper() + s[1:] + f" {_num(rng)}."


def _chat_sample(rng: random.Random) -> str:
    q = _math_sentence(rng)
    a = " ".join(_math_sentence(rng) for _ in range(rng.randint(1, 3)))
    return f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"


def tiny_corpus(seed: int = CORPUS_SEED, n_chars: int = 300_000) -> list[str]:
    """A deterministic English / maths-like corpus (list of documents, ~n_chars in total)."""
    rng = random.Random(seed)
    # Zipf-distributed lexicon: real words first (most frequent), then pseudo-words,
    # so BPE has enough distinct word types to learn a few thousand merges.
    lexicon = _WORDS + _pseudo_words(rng, 6000)
    cum, acc = [], 0.0
    for rank in range(len(lexicon)):
        acc += 1.0 / (rank + 10)
        cum.append(acc)
    docs: list[str] = []
    total = 0
    while total < n_chars:
        r = rng.random()
        if r < 0.45:
            doc = " ".join(_english_sentence(rng, lexicon, cum) for _ in range(rng.randint(2, 6)))
        elif r < 0.85:
            doc = " ".join(_math_sentence(rng) for _ in range(rng.randint(2, 6)))
        else:
            doc = _chat_sample(rng)
        if rng.random() < 0.3:
            doc += "\n\n"
        docs.append(doc)
        total += len(doc)
    return docs


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
    base = Path(env) if env else Path(__file__).resolve().parents[1] / "artifacts" / "tiny-qwen3"
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
