"""The probes' scripted traces: a short prefilled stub (chat template + think opener), then a body fed
token by token through the decode path: filler, the fact (or passcode), filler, and a terminal query
whose value tokens are the measurement points, placed so the fact has been a candidate in exactly
`distance` rounds when the query begins; and the score of one traced output at those points.

The filler here is synthetic reasoning-like text (the paper uses real MATH500 traces; pass your own
with ``filler_text``); it is screened so it never contains the planted variable or value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.engine.config import EvictionSpec
from kvtier.policies import PolicyError
from kvtier.reference import round_schedule

_SUBJECTS = ["the sum", "the product", "the remainder", "the area", "the next term", "the difference",
             "the value of the expression", "the number of cases", "the coefficient", "the angle"]
_STEPS = ["First, note that {a} + {b} = {c}.", "Then we multiply by {a} to get {d}.",
          "So the remainder when {c} is divided by {a} is {e}.", "Let me double check: {a} times {b} is {f}.",
          "Hmm, wait, that gives {c}, which is consistent.", "Now consider {s} again.",
          "Therefore {s} equals {c} in this case.", "We can simplify the fraction {a}/{b} first.",
          "Alternatively, subtract {b} from {c} to get {a}.", "This matches the earlier computation of {s}."]


def synthetic_filler(n_sentences: int, seed: int = 0) -> str:
    """Reasoning-like text with small numbers only (never 4 digits)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        out.append(rng.choice(_STEPS).format(a=a, b=b, c=a + b, d=(a + b) * a, e=(a + b) % a, f=a * b,
                                             s=rng.choice(_SUBJECTS)))
    return " " + " ".join(out)


@dataclass
class ProbeInstance:
    iid: int
    prompt_ids: list[int]
    body: list[int]
    facts: list[tuple[int, int]]          # absolute [start, end) of each fact's tokens
    measure: list[int]                    # body indices of the measured value tokens
    values: list[str]
    seed: int


def _var_names(rng: random.Random, n: int, forbid: str) -> list[str]:
    letters = "bcdfghjklmnpqrstvwxz"
    out = []
    while len(out) < n:
        v = rng.choice("qxzjv") + rng.choice(letters)
        if v not in out and v not in forbid:
            out.append(v)
    return out


def build_instances(tokenizer, *, n: int, budget: int, buffer: int, distance: int, lead: int | None = None,
                    two_facts: bool = False, second_gap: int = 256, kind: str = "fact", seed: int = 0,
                    filler_text: str | None = None, stub_question: str = "Solve the problem below.") -> list[ProbeInstance]:
    """Scripted traces whose (first) fact has been a candidate in exactly `distance` rounds when the query
    begins. kind: "fact" (Let zq = 4729.) or "passcode" (The passcode is 4729.)."""
    rng = random.Random(seed)
    msgs = [{"role": "user", "content": stub_question}]
    try:
        stub = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, enable_thinking=True)
    except Exception:
        stub = tokenizer(stub_question)["input_ids"]
    if hasattr(stub, "keys"):
        stub = stub["input_ids"]
    stub = list(stub)
    stub = stub + tokenizer("<think>\n", add_special_tokens=False)["input_ids"]
    P = len(stub)
    spec = EvictionSpec(policy="random", budget=budget, buffer=buffer, protect_prompt=False)
    # Facts must first become candidates at a steady-state round (the first round evicts fewer than r,
    # which could not remove a pinned-away span at once): after the first round's candidate edge.
    first_qp = round_schedule(P, P + budget + 4 * buffer + 1, spec)[0]
    lead_min = max(first_qp - buffer + 1 - P, 0)
    lead = lead_min + buffer // 2 if lead is None else lead
    if lead < lead_min:
        raise PolicyError(f"lead={lead} puts the fact into the first (partial) round; use lead >= {lead_min}")
    used_values: set[int] = set()
    out = []
    for i in range(n):
        need = lead + (second_gap if two_facts else 0) + (distance + 4) * buffer + 2 * budget
        text = filler_text if filler_text is not None else synthetic_filler(need // 6 + 20, seed=seed * 7919 + i)
        vars_ = _var_names(rng, 2, text)
        vals = []
        while len(vals) < 2:
            v = rng.randint(1000, 9999)
            if v not in used_values and str(v) not in text:
                used_values.add(v)
                vals.append(v)
        filler = tokenizer(text, add_special_tokens=False)["input_ids"]
        if kind == "passcode":
            fact_txt = [f" The passcode is {vals[0]}. Remember it."]
            query = tokenizer(" So the passcode is", add_special_tokens=False)["input_ids"]
            value_pieces = [tokenizer(f" {vals[0]}", add_special_tokens=False)["input_ids"]]
        else:
            fact_txt = [f" Let {vars_[0]} = {vals[0]}."] + ([f" Let {vars_[1]} = {vals[1]}."] if two_facts else [])
            if two_facts:
                query = tokenizer(f" Recall that {vars_[0]} and {vars_[1]} are", add_special_tokens=False)["input_ids"]
                value_pieces = [tokenizer(f" {vals[0]}", add_special_tokens=False)["input_ids"],
                                tokenizer(" and", add_special_tokens=False)["input_ids"],
                                tokenizer(f" {vals[1]}", add_special_tokens=False)["input_ids"]]
            else:
                query = tokenizer(f" Recall that {vars_[0]} =", add_special_tokens=False)["input_ids"]
                value_pieces = [tokenizer(f" {vals[0]}", add_special_tokens=False)["input_ids"]]
        fact_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in fact_txt]
        tail_len = len(query) + sum(len(p) for p in value_pieces)
        if tail_len > buffer:
            raise PolicyError(f"query + value ({tail_len} tokens) must fit the buffer r={buffer}")
        body: list[int] = []
        fi = 0

        def take(k):
            nonlocal fi
            if fi + k > len(filler):
                raise PolicyError("filler text too short for this distance")
            chunk = filler[fi : fi + k]
            fi += k
            return chunk

        body += take(lead)
        facts = []
        a = P + len(body)
        body += fact_ids[0]
        facts.append((a, a + len(fact_ids[0])))
        if two_facts:
            body += take(second_gap)
            a2 = P + len(body)
            body += fact_ids[1]
            facts.append((a2, a2 + len(fact_ids[1])))
        last = facts[0][1] - 1
        horizon = P + len(body) + (distance + 3) * buffer * 4 + budget + 2 * buffer
        qps = [q for q in round_schedule(P, horizon, spec) if q - buffer >= last]
        if len(qps) < distance or distance < 1:
            raise PolicyError("cannot place the query at this distance")
        Q = qps[distance - 1] + 1               # the query starts right after the distance-th round
        if Q < P + len(body):
            raise PolicyError(f"distance {distance} ends before the second fact; raise it or lower second_gap")
        body += take(Q - P - len(body))
        body += query
        measure = []
        for j, piece in enumerate(value_pieces):
            start = len(body)
            body += piece
            if not (two_facts and j == 1):       # " and" between the two values is not measured
                measure.extend(range(start, start + len(piece)))
        out.append(ProbeInstance(i, stub, body, facts, measure,
                                 [str(v) for v in vals[: (2 if two_facts else 1)]], seed=seed * 100_003 + i))
    return out


def score_values(out, inst: ProbeInstance) -> tuple[float, bool]:
    """(LP, exact) of one forced trace at the instance's value tokens: the sum of their log-probs, and
    whether every one is the argmax under teacher forcing."""
    lp = float(sum(out.logprobs[j] for j in inst.measure))
    exact = all(out.argmax[j] == inst.body[j] for j in inst.measure)
    return lp, exact
