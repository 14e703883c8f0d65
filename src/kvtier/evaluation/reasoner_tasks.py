"""Synthetic long chain-of-thought tasks for the shipped reasoner (issue #16): seeded, no downloads.

One problem is a counter program executed line by line. The prompt states the increment ``a``, the
start value ``x`` (both two digits), the number of steps ``n`` (three digits) and what to answer
(``?x``: the final value, a *local chain*; ``?k``: the key, a *needle in the trace*)::

    a=37 x=05 n=100 ?k                      <- prompt (kept whole by Random Attention)
    099 37 24                               <- trace: counter n-1 .. 000, a, x <- (x + a) mod 100
    098 37 97                                  written units digit first (42, 79)
    ...
    067 37 62
    k=62                                    <- the key: written once, right after counter 067
    066 37 36
    ...
    000 37 50
    \\boxed{62}                              <- ?k: the key; ?x: the last value (50)

Every trace line is a function of the previous line alone (a is carried along), so keeping the prompt and
the recent tokens is enough for the chain; the key line is written once, 10 * (n - 67) tokens into the
trace and about 680 tokens before the answer, so answering ``?k`` needs old trace tokens that eviction
may have dropped. What stays determines the key only through 67 * a mod 100 (a table the model would
have to learn instead of one copy); and x repeats only every 100 / gcd(a, 100) lines (50 or more for 60
of the 99 values of a), so copying an old line is no general way to continue the chain.

Design notes (measured while training on this CPU, see src/kvtier/models/reasoner/TRAINING.json): with ``a`` only in
the prompt the tiny model learned to read it slowly; with a carry-free digitwise rule it copied x from 10
lines back (the period) instead of computing it. Carrying ``a`` on every line and writing units first
make each digit a function of tokens at fixed offsets. Still, x's units digit repeats every 10 lines and
its tens digit 10 lines on is the old one + a's units digit; the 500-step model's errors (first 10 lines
of a trace, almost none after line 50) suggest it uses that ~100-token-back relation, so a rule without a
decimal period (e.g. mod 97) is the next design if a longer run shows the same.

Both kinds share the trace; they differ in the prompt's last field and the boxed answer. A trace line is
10 tokens (the reasoner's tokenizer is one token per character, ``\\boxed{`` one token), so ``n`` in
[90, 110] gives 910-1,120 trace tokens: longer than every evaluated budget (128, 256, 512) plus 2r.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("local", "needle")
ASK = {"local": "?x", "needle": "?k"}
N_RANGE = (90, 110)      # steps per problem (inclusive)
KEY_AT = 67              # the key line follows the line whose counter is 67
BOX = "\\boxed{"


def show(x: int) -> str:
    """x in 0..99 as written in a trace: units digit first (so the carry into the tens digit follows
    from the digit just written)."""
    return f"{x % 10}{x // 10}"


@dataclass(frozen=True)
class ChainProblem:
    """One problem: parameters, the prompt text, the full target trace and the gold answer."""

    kind: str            # "local" | "needle"
    a: int               # increment, 1..99
    x0: int              # start value, 0..99
    n: int               # number of trace lines (counters n-1 .. 0)

    @property
    def prompt(self) -> str:
        return f"a={self.a:02d} x={self.x0:02d} n={self.n:03d} {ASK[self.kind]}\n"

    def values(self) -> list[int]:
        """[n] x on each trace line (line i has counter n-1-i): x <- (x + a) mod 100."""
        out, x = [], self.x0
        for _ in range(self.n):
            x = (x + self.a) % 100
            out.append(x)
        return out

    @property
    def key(self) -> int:
        return self.values()[self.n - 1 - KEY_AT]

    @property
    def answer(self) -> str:
        return show(self.key if self.kind == "needle" else self.values()[-1])

    @property
    def trace(self) -> str:
        """The target completion (everything after the prompt), ending with the boxed answer."""
        lines = []
        for i, x in enumerate(self.values()):
            c = self.n - 1 - i
            lines.append(f"{c:03d} {self.a:02d} {show(x)}\n")
            if c == KEY_AT:
                lines.append(f"k={show(x)}\n")
        return "".join(lines) + BOX + self.answer + "}"

    def to_json(self, pid: str) -> dict:
        return {"id": pid, "kind": self.kind, "question": self.prompt, "answer": self.answer,
                "a": self.a, "x0": self.x0, "n": self.n}


def sample_problem(rng: random.Random, kind: str, n_range: tuple[int, int] = N_RANGE) -> ChainProblem:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return ChainProblem(kind, rng.randint(1, 99), rng.randint(0, 99), rng.randint(*n_range))


def problems(seed: int, count: int, kind: str, n_range: tuple[int, int] = N_RANGE) -> list[ChainProblem]:
    """`count` problems of one kind from `seed` (same seed, same problems)."""
    rng = random.Random(f"kvtier-reasoner/{kind}/{seed}")
    return [sample_problem(rng, kind, n_range) for _ in range(count)]


# Seeds: training draws from TRAIN_SEED (and a step counter), held-out evaluation from EVAL_SEED; the
# training script asserts no evaluation problem (a, x0, n, kind) appears in its data.
TRAIN_SEED = 16
EVAL_SEED = 1_000_016


def eval_problems(count: int, kind: str) -> list[ChainProblem]:
    """The held-out set the eval and the README report (first `count` of a fixed sequence)."""
    return problems(EVAL_SEED, count, kind)
