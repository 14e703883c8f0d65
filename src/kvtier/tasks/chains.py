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
answer's tokens (train_config.TrainConfig.answer_weight).

Both kinds share the trace; they differ in the prompt's last field and the boxed answer. A trace line is
10 tokens (the reasoner's tokenizer is one token per character, ``\\boxed{`` one token), so ``n`` in
[90, 110] gives 920-1,130 trace tokens: longer than every evaluated budget (128, 256, 512) plus 2r.

Families (issue #36), chosen by name (`family`, `FAMILIES`): a family is a length range, the counter the
key follows, and its own random streams; the format above is every family's.

* ``chains``: the shipped reasoner's, described above (n in [90, 110], key after counter 067; ~1,000-token
  traces, the key ~680 tokens before the answer). Its problems are the ones the module-level functions
  (`problems`, `eval_problems`, `sample_problem`) have always drawn, byte for byte.
* ``chains-long``: n in [250, 390] (2,522-3,922 trace tokens), the key after counter 160, so the key line
  sits 1,605 tokens before the restated question: at K = 512 a trace is compressed 5-8x and the needle has
  to survive ~1,600 tokens of eviction rounds. A model needs >= 4,096 positions for it.
* ``chains-mid``: training only (the long recipe's p5, reasoner_recipe.py), n in [170, 245] with the key after
  counter 110: the key line 1,105 tokens before the question, a rung between the two distances above.

The length range is a parameter (`Family.problems(..., n_range=)`, e.g. a curriculum's shorter phase); a
needle needs n > key_at (its key line follows counter key_at), a local chain may have any length (1-999).
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
    key_at: int = KEY_AT  # the key follows the line with this counter (the family's)

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
        return self.values()[self.n - 1 - self.key_at]

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
            if c == self.key_at:
                lines.append(f"k={show(x)}\n")
        return "".join(lines) + ASK[self.kind] + "\n" + BOX + self.answer + "}"   # the question, restated

    def to_json(self, pid: str) -> dict:
        return {"id": pid, "kind": self.kind, "question": self.prompt, "answer": self.answer,
                "y0": self.y0, "x0": self.x0, "n": self.n}


def trace_tokens(n: int, key_at: int = KEY_AT) -> int:
    """Tokens of a trace of `n` lines with the reasoner's tokenizer (one per character, ``\\boxed{`` one):
    n + 1 lines of 10, the key line (5) when n > key_at, the question (3) and the boxed answer (4)."""
    return 10 * (n + 1) + (5 if n > key_at else 0) + 3 + 4


@dataclass(frozen=True)
class Family:
    """A named task family: trace lengths, the key's counter and its own seeded streams."""

    name: str
    n_range: tuple[int, int]     # steps per problem (inclusive)
    key_at: int                  # the key line follows the line with this counter
    stream: str                  # random.Random seed prefix of `problems` (each family draws its own)
    max_tokens: int              # a generation budget: the longest trace plus a margin

    def sample_problem(self, rng: random.Random, kind: str, n_range: tuple[int, int] | None = None) -> ChainProblem:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        lo, hi = n_range or self.n_range
        if not 1 <= lo <= hi <= 999:
            raise ValueError(f"n_range must be 1 <= lo <= hi <= 999 (three-digit counters), got {(lo, hi)}")
        if kind == "needle" and lo <= self.key_at:
            raise ValueError(f"{self.name}: a needle needs n > {self.key_at} (its key follows counter "
                             f"{self.key_at:03d}), got n_range {(lo, hi)}")
        y0, x0 = rng.randint(0, 99), rng.randint(1, 99)     # x0 > 0: never the all-zero chain
        return ChainProblem(kind, y0, x0, rng.randint(lo, hi), self.key_at)

    def problems(self, seed: int, count: int, kind: str, n_range: tuple[int, int] | None = None) -> list[ChainProblem]:
        """`count` problems of one kind from `seed` (same seed, same problems)."""
        rng = random.Random(f"{self.stream}/{kind}/{seed}")
        return [self.sample_problem(rng, kind, n_range) for _ in range(count)]

    def eval_problems(self, count: int, kind: str) -> list[ChainProblem]:
        """The held-out set the eval and the README report (first `count` of a fixed sequence)."""
        return self.problems(EVAL_SEED, count, kind)

    def selection_problems(self, count: int, kind: str) -> list[ChainProblem]:
        """A selection set for choosing settings before the runs that judge them (an RL budget, a temperature):
        its own stream, never one of the first SELECTION_EXCLUDES held-out problems (first `count` of a fixed
        sequence)."""
        held_out = {(p.y0, p.x0, p.n) for p in self.eval_problems(SELECTION_EXCLUDES, kind)}
        rng = random.Random(f"{self.stream}/{kind}/{SELECTION_SEED}")
        out: list[ChainProblem] = []
        while len(out) < count:
            p = self.sample_problem(rng, kind)
            if (p.y0, p.x0, p.n) not in held_out:
                out.append(p)
        return out

    @property
    def max_trace_tokens(self) -> int:
        """The longest trace (the reasoner's tokenizer), eos not counted."""
        return trace_tokens(self.n_range[1], self.key_at)

    @property
    def min_trace_tokens(self) -> int:
        return trace_tokens(self.n_range[0], self.key_at)

    @property
    def key_to_question_tokens(self) -> int:
        """Tokens from the key line's start to the restated question's: the key line and the key_at
        trace lines after it (the same for every n > key_at)."""
        return 5 + 10 * self.key_at


# Seeds: training draws from TRAIN_SEED (and a step counter), held-out evaluation from EVAL_SEED; the
# training script asserts no evaluation problem (a, x0, n, kind) appears in its data.
TRAIN_SEED = 16
EVAL_SEED = 1_000_016
SELECTION_SEED = 2_000_016     # Family.selection_problems: settings are chosen there, never on held-out problems
SELECTION_EXCLUDES = 1024      # ... and none of the first this-many held-out problems is in it
SPLITS = ("heldout", "selection")

CHAINS = Family("chains", N_RANGE, KEY_AT, "kvtier-reasoner", max_tokens=1200)   # the shipped reasoner's
CHAINS_LONG = Family("chains-long", (250, 390), 160, "kvtier-reasoner/chains-long", max_tokens=4000)
CHAINS_MID = Family("chains-mid", (170, 245), 110, "kvtier-reasoner/chains-mid", max_tokens=2600)   # training only
FAMILIES = {f.name: f for f in (CHAINS, CHAINS_LONG, CHAINS_MID)}
DEFAULT_FAMILY = CHAINS.name


def family(name: str) -> Family:
    """The family called `name`; ValueError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(FAMILIES)}") from None


# The shipped family's functions, as they always were.
def sample_problem(rng: random.Random, kind: str, n_range: tuple[int, int] = N_RANGE) -> ChainProblem:
    return CHAINS.sample_problem(rng, kind, n_range)


def problems(seed: int, count: int, kind: str, n_range: tuple[int, int] = N_RANGE) -> list[ChainProblem]:
    """`count` problems of one kind from `seed` (same seed, same problems)."""
    return CHAINS.problems(seed, count, kind, n_range)


def eval_problems(count: int, kind: str) -> list[ChainProblem]:
    """The held-out set the eval and the README report (first `count` of a fixed sequence)."""
    return CHAINS.eval_problems(count, kind)
