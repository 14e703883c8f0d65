"""The planted-fact probe (paper §5.2, Appendix B) and the passcode probe (§5.3, Table 3).

Both run on the transformers reference engine: a short prefilled stub (chat template + think opener),
then a fully scripted body fed token by token through the **decode path** (so eviction treats it
exactly as generated reasoning and the model cannot restate anything): filler, the fact, filler, and a
terminal query whose value tokens are the measurement points. The query starts right after an
eviction round and fits inside the buffer, so the question itself is never evicted; ``distance`` is
the number of rounds in which the whole fact was a candidate before the query.

Planted fact: a condition is a set of (layer, KV head) sites in which the fact's tokens are pinned
(score +inf); in every other site they are evicted at first eligibility (score −inf); everything else
gets the standard per-head uniform draw, with no protection rule (`PinnedRandomPolicy`). Each
condition reports retrieval (greedy decoding reproduces the value: every value token is the argmax
under teacher forcing) and LP (sum of the value tokens' log-probs); the graded recall of Eq. 4,

    R = Σ_i (LP_i − LP_i^del) / Σ_i (LP_i^kept − LP_i^del),

uses the fact-kept-everywhere and deleted-everywhere conditions of the same instances (same
background draws: one eviction seed per instance, shared by every condition). The per-round audit
records are checked: the fact survives in exactly the chosen sites (`verify_pins`).

Passcode: a passcode stated once, `distance` rounds before the question; each policy retains as it
sees fit; report retrieval and the mean log-probability of the passcode (Table 3).

The filler here is synthetic reasoning-like text (the paper uses real MATH500 traces; pass your own
with ``filler_text``); it is screened so it never contains the planted variable or value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from kvtier.engine.config import EvictionSpec
from kvtier.policies import EvictionContext, EvictionPolicy, PolicyError
from kvtier.reference import ReferenceEngine, Request, round_schedule

Site = tuple[int, int]


# ----------------------------------------------------------------------------------------------- policy
class PinnedRandomPolicy(EvictionPolicy):
    """Per-head uniform eviction, except fact spans: +inf in their pinned (layer, head) sites, −inf in
    every other site. Not registered (built per condition); reads ``ctx.extras['layer']``."""

    name = "pinned_random"
    default_protect_prompt = False

    def __init__(self, facts: Sequence[tuple[int, int, Iterable[Site]]], **kw) -> None:
        super().__init__(**kw)
        self.facts = [(int(a), int(b), frozenset((int(l), int(h)) for l, h in sites)) for a, b, sites in facts]

    def params(self) -> dict:
        return {**super().params(), "facts": [(a, b, sorted(s)) for a, b, s in self.facts]}

    def score(self, ctx: EvictionContext) -> Tensor:
        if "layer" not in ctx.extras:
            raise PolicyError("pinned_random needs ctx.extras['layer']")
        layer = ctx.extras["layer"]
        pos = ctx.positions
        H = pos.shape[0]
        s = torch.rand(pos.shape, generator=ctx.generator, device=pos.device)
        for a, b, sites in self.facts:
            span = (pos >= a) & (pos < b)
            pinned = torch.tensor([(layer, h) in sites for h in range(H)], device=pos.device).unsqueeze(1)
            s = s.masked_fill(span & pinned, float("inf")).masked_fill(span & ~pinned, float("-inf"))
        return s


def verify_pins(records: Sequence[dict], facts: Sequence[tuple[int, int, Iterable[Site]]]) -> dict:
    """Audit check (Appendix B check ii): at every round where a fact's whole span is a candidate, the
    span is kept in exactly its pinned sites and in no other site. Returns counts and violations."""
    checked, violations = 0, []
    for rec in records:
        if "kept" not in rec:
            continue
        edge = rec["query_position"] - rec["buffer"]
        kept = rec["kept"]
        for fi, (a, b, sites) in enumerate(facts):
            sites = {tuple(s) for s in sites}
            if b - 1 > edge:
                continue                       # still (partly) in the buffer
            checked += 1
            for l, layer in enumerate(kept):
                for h, row in enumerate(layer):
                    held = {p for p in row if a <= p < b}
                    want = set(range(a, b)) if (l, h) in sites else set()
                    if held != want:
                        violations.append({"round": rec["round"], "fact": fi, "site": (l, h),
                                           "held": sorted(held), "expected": sorted(want)})
    return {"checks": checked, "violations": violations, "ok": checked > 0 and not violations}


def parse_sites(text: str, num_layers: int) -> frozenset[Site]:
    """'0,3' -> KV heads 0 and 3 in every layer; '1:0,2:3' -> explicit (layer:head) sites; 'all'/'none'."""
    text = text.strip()
    if text in ("", "none"):
        return frozenset()
    out = set()
    for part in text.split(","):
        if ":" in part:
            l, h = part.split(":")
            out.add((int(l), int(h)))
        else:
            out.update((l, int(part)) for l in range(num_layers))
    return frozenset(out)


# ----------------------------------------------------------------------------------------------- instances
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


# ----------------------------------------------------------------------------------------------- running
def _score(out, inst: ProbeInstance) -> tuple[float, bool]:
    lp = float(sum(out.logprobs[j] for j in inst.measure))
    exact = all(out.argmax[j] == inst.body[j] for j in inst.measure)
    return lp, exact


def recall_R(lp: np.ndarray, kept: np.ndarray, deleted: np.ndarray) -> float:
    den = float((kept - deleted).sum())
    return float((lp - deleted).sum() / den) if den != 0 else float("nan")


def recall_ci(lp, kept, deleted, *, n_boot: int = 4000, seed: int = 0, alpha: float = 0.05) -> tuple[float, float]:
    """Instance-clustered percentile bootstrap of R (the same resampled instances in all three terms)."""
    lp, kept, deleted = map(np.asarray, (lp, kept, deleted))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(lp), size=(n_boot, len(lp)))
    num = (lp[idx] - deleted[idx]).sum(axis=1)
    den = (kept[idx] - deleted[idx]).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        reps = num / den
    reps = reps[np.isfinite(reps)]
    if len(reps) == 0:
        return float("nan"), float("nan")
    lo, hi = np.percentile(reps, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(lo), float(hi)


def run_planted_fact(engine: ReferenceEngine, tokenizer, conditions: dict[str, Sequence], *, n: int = 16,
                     budget: int = 1024, buffer: int = 64, distance: int = 15, two_facts: bool = False,
                     second_gap: int = 256, lead: int | None = None, seed: int = 0, filler_text: str | None = None,
                     max_batch: int | None = None, n_boot: int = 4000, keep_records: bool = True) -> dict:
    """conditions: name -> sites (a set of (layer, head)), or for two facts name -> (sites1, sites2).
    'kept' (all sites) and 'deleted' (none) are always added. Returns per-condition metrics."""
    L, H = engine.num_layers, engine.num_kv_heads
    everywhere = frozenset((l, h) for l in range(L) for h in range(H))
    conds = {"kept": (everywhere, everywhere), "deleted": (frozenset(), frozenset())}
    for name, sites in conditions.items():
        if two_facts and isinstance(sites, tuple) and len(sites) == 2 and not isinstance(sites[0], int):
            conds[name] = (frozenset(map(tuple, sites[0])), frozenset(map(tuple, sites[1])))
        else:
            s = frozenset(map(tuple, sites))
            conds[name] = (s, s)
    insts = build_instances(tokenizer, n=n, budget=budget, buffer=buffer, distance=distance, lead=lead,
                            two_facts=two_facts, second_gap=second_gap, seed=seed, filler_text=filler_text)
    reqs, index = [], []
    for cname, (s1, s2) in conds.items():
        for inst in insts:
            facts = [(inst.facts[0][0], inst.facts[0][1], s1)]
            if two_facts:
                facts.append((inst.facts[1][0], inst.facts[1][1], s2))
            pol = PinnedRandomPolicy(facts, protect_prompt=False)
            spec = EvictionSpec(policy=pol, budget=budget, buffer=buffer, seed=inst.seed)
            reqs.append(Request(inst.prompt_ids, spec, max_new_tokens=len(inst.body), forced=inst.body,
                                req_id=f"{cname}/{inst.iid}"))
            index.append((cname, inst, facts))
    outs = engine.generate(reqs, keep_records=keep_records, max_batch=max_batch)
    res: dict[str, dict] = {c: {"lp": [], "exact": [], "rounds": [], "pins": {"checks": 0, "violations": 0}}
                            for c in conds}
    for (cname, inst, facts), o in zip(index, outs):
        lp, ex = _score(o, inst)
        r = res[cname]
        r["lp"].append(lp)
        r["exact"].append(ex)
        r["rounds"].append(o.rounds)
        if keep_records:
            v = verify_pins(o.records, facts)
            r["pins"]["checks"] += v["checks"]
            r["pins"]["violations"] += len(v["violations"])
    kept, deleted = np.array(res["kept"]["lp"]), np.array(res["deleted"]["lp"])
    summary = {}
    for cname, r in res.items():
        lp = np.array(r["lp"])
        lo, hi = recall_ci(lp, kept, deleted, n_boot=n_boot, seed=seed)
        summary[cname] = {
            "sites_fact1": sorted(conds[cname][0]) if cname not in ("kept",) else "all",
            **({"sites_fact2": sorted(conds[cname][1]) if cname != "kept" else "all"} if two_facts else {}),
            "retrieval": float(np.mean(r["exact"])), "mean_lp": float(lp.mean()),
            "R": recall_R(lp, kept, deleted), "R_ci": [lo, hi],
            "rounds_per_trace": float(np.mean(r["rounds"])),
            "pins_checked": r["pins"]["checks"], "pin_violations": r["pins"]["violations"],
        }
    return {"probe": "planted_fact", "instances": n, "budget": budget, "buffer": buffer, "distance": distance,
            "two_facts": two_facts, "per_copy_survival": (budget / (budget + buffer)) ** distance,
            "body_tokens": len(insts[0].body), "conditions": summary,
            "outputs": outs if keep_records else None, "instances_detail": insts}


def run_passcode(engine: ReferenceEngine, tokenizer, policies: dict[str, EvictionSpec | str] | Sequence[str], *,
                 n: int = 16, budget: int = 1024, buffer: int = 64, distance: int = 57, lead: int | None = None,
                 seed: int = 0, filler_text: str | None = None, max_batch: int | None = None) -> dict:
    """Table 3. policies: registered names (each with its own default protection), "full", or
    name -> EvictionSpec (budget/buffer default to the arguments)."""
    if not isinstance(policies, dict):
        policies = {p: p for p in policies}
    specs = {}
    for name, sp in policies.items():
        if isinstance(sp, str):
            sp = EvictionSpec(budget=None) if sp == "full" else EvictionSpec(policy=sp, budget=budget)
        elif sp.policy != "full" and sp.budget is None and sp.policy is not None and name != "full":
            sp = EvictionSpec(policy=sp.policy, budget=budget, buffer=buffer, protect_prompt=sp.protect_prompt,
                           sinks=sp.sinks, params=sp.params)
        specs[name] = sp
    insts = build_instances(tokenizer, n=n, budget=budget, buffer=buffer, distance=distance, lead=lead,
                            kind="passcode", seed=seed, filler_text=filler_text)
    reqs, index = [], []
    for name, sp in specs.items():
        for inst in insts:
            spec = EvictionSpec(policy=sp.policy, budget=sp.budget, buffer=buffer, protect_prompt=sp.protect_prompt,
                             sinks=sp.sinks, seed=inst.seed, params=sp.params)
            reqs.append(Request(inst.prompt_ids, spec, max_new_tokens=len(inst.body), forced=inst.body,
                                req_id=f"{name}/{inst.iid}"))
            index.append((name, inst))
    outs = engine.generate(reqs, keep_records=False, max_batch=max_batch)
    res: dict[str, dict] = {name: {"lp": [], "exact": []} for name in specs}
    for (name, inst), o in zip(index, outs):
        lp, ex = _score(o, inst)
        res[name]["lp"].append(lp)
        res[name]["exact"].append(ex)
    return {"probe": "passcode", "instances": n, "budget": budget, "buffer": buffer, "distance": distance,
            "policies": {name: {"retrieval": float(np.mean(r["exact"])), "mean_logp": float(np.mean(r["lp"]))}
                         for name, r in res.items()}}


def format_planted(result: dict) -> str:
    lines = [f"planted fact: {result['instances']} traces, K={result['budget']}, r={result['buffer']}, "
             f"distance={result['distance']} rounds (per-copy survival {(result['per_copy_survival']):.3f})", "",
             "| condition | retrieval | mean LP | R | R 95% CI | pins checked / violations |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, c in result["conditions"].items():
        lines.append(f"| {name} | {c['retrieval']:.3f} | {c['mean_lp']:.2f} | {c['R']:.3f} | "
                     f"[{c['R_ci'][0]:.3f}, {c['R_ci'][1]:.3f}] | {c['pins_checked']} / {c['pin_violations']} |")
    return "\n".join(lines) + "\n"


def format_passcode(result: dict) -> str:
    lines = [f"passcode: {result['instances']} traces, stated once {result['distance']} rounds before the question", "",
             "| policy | Retr. | log p |", "| --- | --- | --- |"]
    for name, c in result["policies"].items():
        lines.append(f"| {name} | {c['retrieval']:.3f} | {c['mean_logp']:.2f} |")
    return "\n".join(lines) + "\n"
