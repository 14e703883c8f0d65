"""The key-line probe (issue #36; the seed paper's §5.2, the shape of its Figure 3a, on the reasoner's own
needle task): needle retrieval against the number of KV heads that keep the key line.

Instances are a task family's held-out needle problems (bos + prompt, then the gold trace, teacher-forced).
In condition h (0..num_kv_heads), h KV heads of every layer keep the key line's tokens (``k=NN`` and its
newline) for the whole trace and every other head evicts them at their first eligible round
(`PinnedRandomPolicy`: +inf / -inf); everything else is evicted uniformly at random per head at budget K,
the prompt kept (Random Attention's rule). Which h heads: a random order of the heads per (instance,
layer), its first h, so each condition's heads contain the previous one's and head identity averages out.

The deaths are simulated with the engines' schedule (`kvtier.deathtime.simulate_deaths`) and the trace
runs as one forward under them (death-time attention: what an engine computes for these keep-sets), so a
condition costs one forward per instance. One eviction seed per instance, shared by every condition: the
conditions evict the same entries until the key's first eligible round, and draw from the same stream after. Measured at the boxed answer's digits: retrieval (every digit the argmax), LP
(their summed log-probs) and the graded recall R of Eq. 4 between h = all heads and h = 0, with its
instance-bootstrap CI (`planted_fact.recall_R`); and retrieval at full attention (no eviction at all), the
ceiling the conditions are read against. The audit (`pins_hold`): in every instance and condition the key's
tokens are never evicted in the chosen heads and are gone from every other head before the question; a
budget whose rounds do not reach the key before the question is refused (ValueError naming K).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvtier.evaluation.probes.pinning import PinnedRandomPolicy
from kvtier.evaluation.probes.planted_fact import recall_ci, recall_R
from kvtier.evaluation.stats import bootstrap_replicates
from kvtier.tasks import chains as rt


@dataclass
class KeyLineInstance:
    iid: int
    ids: list[int]                 # bos + prompt + gold trace
    prompt_len: int
    key: tuple[int, int]           # [start, end) of the key line's tokens
    question: int                  # first token of the restated question
    answer: list[int]              # positions of the boxed answer's tokens
    seed: int                      # the instance's eviction seed (every condition)


def key_line_instances(tokenizer, family: str, n: int, seed: int = 0) -> list[KeyLineInstance]:
    """The first `n` held-out needle problems of `family`, with their key line and answer located."""
    out = []
    for i, p in enumerate(rt.family(family).eval_problems(n, "needle")):
        prompt = tokenizer(p.prompt)["input_ids"]
        trace = p.trace
        at = lambda chars: len(prompt) + len(tokenizer(trace[:chars], add_special_tokens=False)["input_ids"])  # noqa: E731
        k = trace.index("\nk=") + 1
        q = trace.rindex("\n" + rt.ASK["needle"] + "\n") + 1
        a = trace.rindex(rt.BOX) + len(rt.BOX)
        ids = prompt + tokenizer(trace, add_special_tokens=False)["input_ids"]
        answer = list(range(at(a), at(a + len(p.answer))))
        if [ids[j] for j in answer] != tokenizer(p.answer, add_special_tokens=False)["input_ids"]:
            raise ValueError(f"needle {i}: the answer's tokens are not where the trace's text puts them")
        out.append(KeyLineInstance(i, ids, len(prompt), (at(k), at(trace.index("\n", k) + 1)), at(q), answer,
                                   seed=seed * 100_003 + i))
    return out


def head_orders(inst: KeyLineInstance, num_layers: int, num_kv_heads: int) -> list[list[int]]:
    """Per layer, a random order of the KV heads (seeded by the instance); condition h keeps its first h."""
    rng = random.Random(f"key-line/{inst.seed}")
    return [rng.sample(range(num_kv_heads), num_kv_heads) for _ in range(num_layers)]


def deaths_for_condition(inst: KeyLineInstance, h: int, num_layers: int, num_kv_heads: int, budget: int,
                         buffer: int):
    """[layers, kv_heads, T] death times: the key line kept in h heads per layer, evicted elsewhere."""
    from kvtier.deathtime import simulate_deaths
    from kvtier.policies import EvictionSchedule

    orders = head_orders(inst, num_layers, num_kv_heads)
    sites = [(l, hd) for l in range(num_layers) for hd in orders[l][:h]]
    policy = PinnedRandomPolicy([(inst.key[0], inst.key[1], sites)], protect_prompt=True)
    return simulate_deaths(policy, EvictionSchedule(budget=budget, buffer=buffer), inst.prompt_len, len(inst.ids),
                           num_layers=num_layers, num_kv_heads=num_kv_heads, seed=inst.seed), sites


def pins_hold(deaths, inst: KeyLineInstance, sites) -> bool:
    """The audit: the key never dies in its chosen sites and is gone from every other one before the question."""
    from kvtier.deathtime import NEVER

    a, b = inst.key
    L, H, _ = deaths.shape
    chosen = set(sites)
    for l in range(L):
        for hd in range(H):
            d = deaths[l, hd, a:b]
            if (l, hd) in chosen and not bool((d == NEVER).all()):
                return False
            if (l, hd) not in chosen and not bool((d <= inst.question).all()):
                return False
    return True


def run_key_line_probe(model, tokenizer, *, family: str, heads: list[int] | None = None, n: int = 32,
                       budget: int = 512, buffer: int = 32, seed: int = 0, n_boot: int = 4000, log=None) -> dict:
    """Retrieval, LP and R per number of KV heads keeping the key line. `model`: a causal LM loaded with
    kvtier.deathtime's attention (ATTN_NAME), eval mode."""
    import torch

    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    heads = sorted(set(range(H + 1) if heads is None else heads) | {0, H})
    if heads[0] < 0 or heads[-1] > H:
        raise ValueError(f"heads must be within 0..{H} (the model's KV heads per layer), got {heads}")
    insts = key_line_instances(tokenizer, family, n, seed)
    res = {h: {"lp": [], "exact": []} for h in [*heads, "full"]}

    def score(key, ids, inst, **kw) -> None:
        logits = model(input_ids=ids, **kw).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        pred = [j - 1 for j in inst.answer]                    # the logits that predict each answer token
        res[key]["lp"].append(float(sum(logp[p, inst.ids[j]] for p, j in zip(pred, inst.answer))))
        res[key]["exact"].append(all(int(logits[p].argmax()) == inst.ids[j] for p, j in zip(pred, inst.answer)))

    with torch.no_grad():
        for inst in insts:
            ids = torch.tensor([inst.ids])
            score("full", ids, inst)                           # no eviction: the ceiling
            for h in heads:
                deaths, sites = deaths_for_condition(inst, h, L, H, budget, buffer)
                if not pins_hold(deaths, inst, sites):
                    raise ValueError(f"budget K={budget}, r={buffer}: needle {inst.iid}'s key line is not evicted "
                                     f"from every unchosen head before the question ({h} heads keeping it); the "
                                     "rounds must reach it: lower the budget")
                score(h, ids, inst, kvtier_deaths=deaths.unsqueeze(0))
            if log:
                log(f"instance {inst.iid + 1}/{len(insts)}: retrieved at h = "
                    f"{[h for h in heads if res[h]['exact'][-1]]}")
    kept, deleted = np.array(res[H]["lp"]), np.array(res[0]["lp"])

    def retrieval(key) -> dict:
        exact = np.array(res[key]["exact"], dtype=float)
        lo, hi = np.percentile(bootstrap_replicates(exact, n_boot, seed), [2.5, 97.5])
        return {"retrieval": float(exact.mean()), "retrieval_ci": [float(lo), float(hi)],
                "mean_lp": float(np.mean(res[key]["lp"]))}

    conditions = []
    for h in heads:
        lp = np.array(res[h]["lp"])
        conditions.append({"heads_keeping_key": h, **retrieval(h), "R": recall_R(lp, kept, deleted), "R_ci": list(recall_ci(lp, kept, deleted, n_boot=n_boot, seed=seed)),
                           "exact": [bool(e) for e in res[h]["exact"]]})
    return {"probe": "key_line", "family": family, "instances": len(insts), "budget": budget, "buffer": buffer,
            "full_attention": retrieval("full"),
            "pins_audited": len(insts) * len(heads),             # (instance, condition) pairs; a failed one raises
            "num_layers": L, "num_kv_heads": H, "seed": seed,
            "key_to_question_tokens": rt.family(family).key_to_question_tokens, "conditions": conditions}


def format_key_line(result: dict) -> str:
    lines = [f"key-line probe: {result['instances']} needles of {result['family']}, random K = {result['budget']}, "
             f"r = {result['buffer']}, {result['num_kv_heads']} KV heads x {result['num_layers']} layers; every pin held",
             "", "| KV heads keeping the key line (per layer) | retrieval [95% CI] | mean LP | R [95% CI] |",
             "| --- | --- | --- | --- |"]
    f = result["full_attention"]
    for c in result["conditions"]:
        lines.append(f"| {c['heads_keeping_key']} of {result['num_kv_heads']} | {c['retrieval']:.2f} "
                     f"[{c['retrieval_ci'][0]:.2f}, {c['retrieval_ci'][1]:.2f}] | {c['mean_lp']:.2f} | {c['R']:.2f} "
                     f"[{c['R_ci'][0]:.2f}, {c['R_ci'][1]:.2f}] |")
    lines.append(f"| full attention (no eviction) | {f['retrieval']:.2f} [{f['retrieval_ci'][0]:.2f}, "
                 f"{f['retrieval_ci'][1]:.2f}] | {f['mean_lp']:.2f} | |")
    return "\n".join(lines) + "\n"
