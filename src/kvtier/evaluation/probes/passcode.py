"""The passcode probe (paper §5.3, Table 3): a passcode stated once, `distance` rounds before the
question; each policy retains as it sees fit; report retrieval and the mean log-probability of the
passcode, and format the table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvtier.engine.config import EvictionSpec
from kvtier.evaluation.probes.instances import build_instances, score_values
from kvtier.reference import ReferenceEngine, Request


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
        lp, ex = score_values(o, inst)
        res[name]["lp"].append(lp)
        res[name]["exact"].append(ex)
    return {"probe": "passcode", "instances": n, "budget": budget, "buffer": buffer, "distance": distance,
            "policies": {name: {"retrieval": float(np.mean(r["exact"])), "mean_logp": float(np.mean(r["lp"]))}
                         for name, r in res.items()}}


def format_passcode(result: dict) -> str:
    lines = [f"passcode: {result['instances']} traces, stated once {result['distance']} rounds before the question", "",
             "| policy | Retr. | log p |", "| --- | --- | --- |"]
    for name, c in result["policies"].items():
        lines.append(f"| {name} | {c['retrieval']:.3f} | {c['mean_logp']:.2f} |")
    return "\n".join(lines) + "\n"
