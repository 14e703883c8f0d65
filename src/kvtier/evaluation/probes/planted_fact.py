"""The planted-fact probe (paper §5.2, Appendix B): run every condition on the same instances and report
retrieval, LP and the graded recall of Eq. 4 with its bootstrap CI, and format the table.

Each condition reports retrieval (greedy decoding reproduces the value: every value token is the argmax
under teacher forcing) and LP (sum of the value tokens' log-probs); the graded recall of Eq. 4,

    R = Σ_i (LP_i − LP_i^del) / Σ_i (LP_i^kept − LP_i^del),

uses the fact-kept-everywhere and deleted-everywhere conditions of the same instances (same
background draws: one eviction seed per instance, shared by every condition), and each trace's audit
records are checked against its pins (`verify_pins`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvtier.engine.config import EvictionSpec
from kvtier.evaluation.probes.instances import build_instances, score_values
from kvtier.evaluation.probes.pinning import PinnedRandomPolicy, verify_pins
from kvtier.reference import ReferenceEngine, Request


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
        lp, ex = score_values(o, inst)
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


def format_planted(result: dict) -> str:
    lines = [f"planted fact: {result['instances']} traces, K={result['budget']}, r={result['buffer']}, "
             f"distance={result['distance']} rounds (per-copy survival {(result['per_copy_survival']):.3f})", "",
             "| condition | retrieval | mean LP | R | R 95% CI | pins checked / violations |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, c in result["conditions"].items():
        lines.append(f"| {name} | {c['retrieval']:.3f} | {c['mean_lp']:.2f} | {c['R']:.3f} | "
                     f"[{c['R_ci'][0]:.3f}, {c['R_ci'][1]:.3f}] | {c['pins_checked']} / {c['pin_violations']} |")
    return "\n".join(lines) + "\n"
