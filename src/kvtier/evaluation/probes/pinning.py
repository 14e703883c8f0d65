"""The planted-fact probe's pinning: the policy that keeps a fact in chosen (layer, KV head) sites and
evicts it everywhere else, the audit check that it did, and the `--conditions` site syntax.

A condition is a set of (layer, KV head) sites in which the fact's tokens are pinned (score +inf); in
every other site they are evicted at first eligibility (score −inf); everything else gets the standard
per-head uniform draw, with no protection rule (`PinnedRandomPolicy`). The per-round audit records are
checked: the fact survives in exactly the chosen sites (`verify_pins`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from kvtier.policies import EvictionContext, EvictionPolicy, PolicyError

Site = tuple[int, int]


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
