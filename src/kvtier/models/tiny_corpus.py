"""The corpus the tiny Qwen3's tokenizer is trained on (kvtier.models.tiny): deterministic English- and
maths-like documents and ChatML chat samples, generated from word lists with a fixed seed.

The corpus only shapes the vocabulary (which BPE merges exist); it never depends on the weight seed, so tiny
models of every seed share one tokenizer. Any change here changes tokenizer.json (and the model's bytes):
bump ``BUILD_VERSION`` in kvtier.models.tiny with it.
"""

from __future__ import annotations

import random

__all__ = ["CORPUS_SEED", "IM_END", "IM_START", "tiny_corpus"]

CORPUS_SEED = 1234  # fixed: the tokenizer does not depend on the weight seed

# ChatML markers: the chat samples use them, and the tokenizer adds them as special tokens.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

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

