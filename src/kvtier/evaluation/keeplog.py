"""Keep-log statistics (paper Appendix D) from audit logs of either engine.

An audit record is one request-round: {req_id, round, query_position qp, prompt_len ℓp, budget K, buffer
r, kept: [layers][kv_heads][K] logical positions kept outside the buffer}. Before a round, a head's
candidates are what it kept at its previous round plus the positions that left the buffer since
((qp_prev − r, qp − r]); at the first round, every position ≤ qp − r.

* slot coverage: per layer, |∪_heads kept| / |∪_heads candidates| right after a round;
* prompt survival: fraction of prompt positions still held, by any head of a layer (union) and by a
  given head (per head);
* survival by age: for generated positions (p ≥ ℓp) with age a = qp − p at a round, the fraction held by
  a head (per head) and by any head of the layer (union), in age bands;
* survival by rounds: the same by n, the number of rounds a position has been a candidate; for
  ``random`` its expectation is Π over those rounds of (K − ℓp)/(S − ℓp) (S = candidates at the round),
  i.e. ((K − ℓp)/(K + r − ℓp))^n in steady state (``closed_form``, averaged over the same samples).

Statistics average over rounds, layers and requests. Preemption resets restart a request's chain.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


def read_records(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(l) for l in fh if l.strip()]


def by_request(records: Iterable[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        out[r["req_id"]].append(r)
    return out


def default_bands(max_age: int, buffer: int) -> list[int]:
    """Age band edges (tokens): [r, 2r), [2r, 4r), ... doubling past max_age."""
    edges = [buffer]
    while edges[-1] <= max_age:
        edges.append(edges[-1] * 2)
    return edges


class _Acc:
    def __init__(self):
        self.num = defaultdict(float)
        self.den = defaultdict(float)

    def add(self, key, held, total):
        self.num[key] += held
        self.den[key] += total

    def frac(self):
        return {k: self.num[k] / self.den[k] for k in sorted(self.den) if self.den[k] > 0}


def keeplog_stats(records: Sequence[dict], *, protected: int | None = None, bands: Sequence[int] | None = None,
                  max_rounds_n: int = 64) -> dict:
    """Appendix D statistics over every request in `records`.

    protected: positions < this are never evicted by the policy (for the closed form); default: ℓp when
    every round kept the whole prompt in every head, else 0.
    """
    reqs = by_request(records)
    coverage, p_union, p_head = [], [], []
    age_head, age_union = _Acc(), _Acc()
    n_head, n_expect, n_steady, n_steady_expect = _Acc(), _Acc(), _Acc(), _Acc()
    meta = {}
    max_age = 0
    for recs in reqs.values():
        for r in recs:
            if "kept" in r:
                max_age = max(max_age, r["query_position"])
    for rid, recs in reqs.items():
        chain = []
        for r in recs:                        # split at preemption resets
            if "kept" not in r:
                if chain:
                    _one_chain(chain, protected, bands, max_age, coverage, p_union, p_head, age_head, age_union,
                               n_head, n_expect, n_steady, n_steady_expect, meta, max_rounds_n)
                chain = []
            else:
                chain.append(r)
        if chain:
            _one_chain(chain, protected, bands, max_age, coverage, p_union, p_head, age_head, age_union, n_head,
                       n_expect, n_steady, n_steady_expect, meta, max_rounds_n)
    def band_list(acc):
        return [{"age_lo": lo, "age_hi": hi, "survival": v} for (lo, hi), v in acc.frac().items()]
    nh, ne = n_head.frac(), n_expect.frac()
    sh, se = n_steady.frac(), n_steady_expect.frac()
    return {
        "requests": len(reqs),
        "rounds": sum(1 for r in records if "kept" in r),
        **meta,
        "slot_coverage": float(np.mean(coverage)) if coverage else None,
        "prompt_survival_union": float(np.mean(p_union)) if p_union else None,
        "prompt_survival_per_head": float(np.mean(p_head)) if p_head else None,
        "survival_by_age_per_head": band_list(age_head),
        "survival_by_age_union": band_list(age_union),
        "survival_by_rounds": [{"n": n, "survival": nh[n], "expected_random": ne[n],
                                "samples": n_head.den[n]} for n in nh],
        "survival_by_rounds_steady": [{"n": n, "survival": sh[n], "closed_form": se[n],
                                       "samples": n_steady.den[n]} for n in sh],
    }


def _one_chain(chain, protected, bands, max_age, coverage, p_union, p_head, age_head, age_union, n_head, n_expect,
               n_steady, n_steady_expect, meta, max_rounds_n):
    chain = sorted(chain, key=lambda r: r["query_position"])
    r0 = chain[0]
    lp, K, r = r0["prompt_len"], r0["budget"], r0["buffer"]
    meta.setdefault("budget", K)
    meta.setdefault("buffer", r)
    kept0 = np.asarray(r0["kept"])
    L, H = kept0.shape[:2]
    last_qp = chain[-1]["query_position"]
    N = last_qp + 1
    if protected is None:
        prot = lp if K >= lp and all(np.array_equal(np.asarray(c["kept"])[:, :, :lp],
                                                    np.broadcast_to(np.arange(lp), (L, H, lp))) for c in chain) else 0
    else:
        prot = protected
    meta.setdefault("protected", prot)
    edges = list(bands) if bands else default_bands(max_age, r)
    held_prev = None
    cand_rounds = np.zeros(N, dtype=np.int64)          # rounds each position has been a candidate
    log_expect = np.zeros(N, dtype=np.float64)         # Σ log survival prob under random
    steady = np.ones(N, dtype=bool)                    # every one of its rounds had S = K + r
    for i, rec in enumerate(chain):
        qp = rec["query_position"]
        edge = qp - r                                  # candidates are positions <= edge
        kept = np.asarray(rec["kept"])                 # [L, H, K]
        held = np.zeros((L, H, N), dtype=bool)
        np.put_along_axis(held, kept, True, axis=2)
        cand = np.zeros((L, H, N), dtype=bool)
        if held_prev is None:
            cand[:, :, : edge + 1] = True
        else:
            prev_edge = chain[i - 1]["query_position"] - r
            cand |= held_prev
            cand[:, :, prev_edge + 1 : edge + 1] = True
        S = int(cand[0, 0].sum())
        # coverage per layer
        cu, hu = cand.any(axis=1), held.any(axis=1)     # [L, N]
        coverage.append(float((hu.sum(axis=1) / np.maximum(cu.sum(axis=1), 1)).mean()))
        if lp > 0:
            p_union.append(float(held[:, :, :lp].any(axis=1).mean()))
            p_head.append(float(held[:, :, :lp].mean()))
        # rounds of candidacy and expectation under random
        positions = np.arange(N)
        is_cand = positions <= edge
        cand_rounds[is_cand] += 1
        gen_cand = is_cand & (positions >= prot)
        if S - prot > 0:
            log_expect[gen_cand] += math.log(max(K - prot, 0) / (S - prot)) if K > prot else -np.inf
        if S != K + r:
            steady[gen_cand] = False
        # survival by age (generated positions only)
        gen = np.arange(lp, edge + 1)
        if len(gen):
            ages = qp - gen
            hh = held[:, :, lp : edge + 1]                # [L, H, g]
            per_pos_head = hh.sum(axis=(0, 1))            # heads (over layers) holding each position
            per_pos_union = hh.any(axis=1).sum(axis=0)    # layers in which some head holds it
            band_idx = np.searchsorted(edges, ages, side="right") - 1
            for b in np.unique(band_idx):
                if b < 0 or b + 1 >= len(edges):
                    continue
                m = band_idx == b
                key = (edges[b], edges[b + 1])
                age_head.add(key, float(per_pos_head[m].sum()), float(m.sum() * L * H))
                age_union.add(key, float(per_pos_union[m].sum()), float(m.sum() * L))
            # survival by rounds of candidacy
            nr = cand_rounds[lp : edge + 1]
            for n in np.unique(nr):
                if n <= 0 or n > max_rounds_n:
                    continue
                m = nr == n
                cnt = float(m.sum() * L * H)
                n_head.add(int(n), float(per_pos_head[m].sum()), cnt)
                n_expect.add(int(n), float(np.exp(log_expect[lp : edge + 1][m]).sum() * L * H), cnt)
                ms = m & steady[lp : edge + 1] & (np.arange(lp, edge + 1) >= prot)
                if ms.any():
                    c2 = float(ms.sum() * L * H)
                    n_steady.add(int(n), float(per_pos_head[ms].sum()), c2)
                    q = (K - prot) / (K + r - prot)
                    n_steady_expect.add(int(n), q ** int(n) * c2, c2)
        held_prev = held


def plot_survival(stats_by_name: dict[str, dict], path: str | Path, *, union: bool = True) -> Path:
    """Figure 4: fraction of positions of a given age a head still holds (log scale), per policy; dashed:
    the cross-head union over a layer's KV heads. Geometric decay (random) is a straight line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, st in stats_by_name.items():
        bands = st["survival_by_age_per_head"]
        if not bands:
            continue
        x = [math.sqrt(b["age_lo"] * b["age_hi"]) for b in bands]
        line, = ax.plot(x, [max(b["survival"], 1e-4) for b in bands], marker="o", label=f"{name} (per head)")
        if union and st["survival_by_age_union"]:
            u = st["survival_by_age_union"]
            ax.plot([math.sqrt(b["age_lo"] * b["age_hi"]) for b in u], [max(b["survival"], 1e-4) for b in u],
                    linestyle="--", color=line.get_color(), label=f"{name} (union over heads)")
    ax.set_yscale("log")
    ax.set_xlabel("age (tokens since the position was written)")
    ax.set_ylabel("fraction still held")
    ax.set_title("Survival by age (Appendix D, Figure 4)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
