"""Synthetic long chain-of-thought tasks for the shipped reasoner (issue #16): seeded, no downloads.

One problem is a two-term recurrence executed line by line. The prompt states the two start values
``y`` and ``x`` (two digits each), the number of steps ``n`` (three digits) and what to answer (``?x``:
the final value, a *local chain*; ``?k``: the key, a *needle in the trace*)::

    y=37 x=05 n=100 ?k                      <- prompt (kept whole by Random Attention)
    100 73 50                               <- the start restated in the trace's format (counter n)
    099 50 24                               <- trace: counter n-1 .. 000, then (y, x) <- (x, (y + x) mod 100),
    098 24 74                                  both written units digit first (05 42, 42 47)
    ...
    067 32 12
    k=12                                    <- the key: written once, right after counter 067
    066 12 44
    ...
    000 73 08
    ?k                                      <- the question, restated (copied from the prompt)
    \\boxed{12}                              <- ?k: the key; ?x: the last value (80, written 08)

Every trace line is a function of the previous line alone (its second field is the previous line's third,
its third the sum of the previous line's two), so keeping the prompt and the recent tokens is enough for
the chain; the key line is written once, 10 * (n - 67) tokens into the trace and about 680 tokens before
the answer, so answering ``?k`` needs old trace tokens that eviction may have dropped (what stays
determines the key only by running the recurrence 67 steps backwards).

Design notes (measured while training on this CPU, see src/kvtier/models/reasoner/TRAINING.json): with an
increment stated only in the prompt the tiny model learned to read it slowly; with a carry-free digitwise
rule it copied x from 10 lines back (the period) instead of computing it; with ``x <- (x + a) mod 100``
(``a`` carried on every line) the units digit repeats every 10 lines and the tens digit 10 lines on is the
old one + a's units digit, and the 500-step model used that carry-free ~100-token-back shortcut: its
errors were in the first 10 lines (0/16 traces right). This recurrence has no such shortcut (its units
digits repeat only every 60 lines for most start pairs, its tens digits every 300), so every line needs
the two-digit addition with carry the trace is about.

The trace's first line restates the start (counter n, y and x units digit first): the model that computed
the first step straight from the prompt's tens-first numbers got its tens digit wrong in most traces. Its
other remaining error was the boxed answer, which had to read the question ~1,000 tokens back while
deciding what to box (one answer per trace: little signal): the trace now restates the question first (a
copy of the two characters after the prompt's only ``?``), and the last training phases weight the
answer's tokens (reasoner_train.TrainConfig.answer_weight).

Both kinds share the trace; they differ in the prompt's last field and the boxed answer. A trace line is
10 tokens (the reasoner's tokenizer is one token per character, ``\\boxed{`` one token), so ``n`` in
[90, 110] gives 920-1,130 trace tokens: longer than every evaluated budget (128, 256, 512) plus 2r.
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
    y0: int              # the value before x0, 0..99 (y0 and x0 not both 0)
    x0: int              # start value, 0..99
    n: int               # number of trace lines (counters n-1 .. 0)

    @property
    def prompt(self) -> str:
        return f"y={self.y0:02d} x={self.x0:02d} n={self.n:03d} {ASK[self.kind]}\n"

    def pairs(self) -> list[tuple[int, int]]:
        """[n] (y, x) on each trace line (line i has counter n-1-i): (y, x) <- (x, (y + x) mod 100)."""
        out, y, x = [], self.y0, self.x0
        for _ in range(self.n):
            y, x = x, (y + x) % 100
            out.append((y, x))
        return out

    def values(self) -> list[int]:
        """[n] x on each trace line."""
        return [x for _, x in self.pairs()]

    @property
    def key(self) -> int:
        return self.values()[self.n - 1 - KEY_AT]

    @property
    def answer(self) -> str:
        return show(self.key if self.kind == "needle" else self.values()[-1])

    @property
    def trace(self) -> str:
        """The target completion (everything after the prompt), ending with the boxed answer."""
        lines = [f"{self.n:03d} {show(self.y0)} {show(self.x0)}\n"]   # the start, restated in the trace's format
        for i, (y, x) in enumerate(self.pairs()):
            c = self.n - 1 - i
            lines.append(f"{c:03d} {show(y)} {show(x)}\n")
            if c == KEY_AT:
                lines.append(f"k={show(x)}\n")
        return "".join(lines) + ASK[self.kind] + "\n" + BOX + self.answer + "}"   # the question, restated

    def to_json(self, pid: str) -> dict:
        return {"id": pid, "kind": self.kind, "question": self.prompt, "answer": self.answer,
                "y0": self.y0, "x0": self.x0, "n": self.n}


def sample_problem(rng: random.Random, kind: str, n_range: tuple[int, int] = N_RANGE) -> ChainProblem:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    y0, x0 = rng.randint(0, 99), rng.randint(1, 99)     # x0 > 0: never the all-zero chain
    return ChainProblem(kind, y0, x0, rng.randint(*n_range))


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
