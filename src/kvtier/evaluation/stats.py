"""The paper's significance treatment (§4.1, Appendix B): paired, problem-clustered percentile bootstrap
(95% CI) plus an exact two-sided sign test, for every pair of methods evaluated on the same problems.

Data for one method is {problem_id: [score of run 0, score of run 1, ...]} (scores 0/1 for accuracy, or
any real number, e.g. a log-probability). Pairing is by problem; a problem is the resampling unit (its
runs move together), so correlated runs of one problem never count as independent evidence.

* bootstrap: d_i = mean_runs(A_i) - mean_runs(B_i) over the shared problems; resample problems with
  replacement `n_boot` times; the CI is the (alpha/2, 1-alpha/2) percentiles of the resampled mean of d.
* sign test: per problem the sign of d_i (ties dropped); two-sided exact binomial test of
  #positive out of #non-tied against p = 1/2 (scipy.stats.binomtest).
* a difference is significant when the CI excludes 0 **and** the sign test's p < alpha.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

Scores = Mapping[object, Sequence[float]]


def _paired(a: Scores, b: Scores) -> tuple[list, np.ndarray]:
    shared = [p for p in a if p in b and len(a[p]) and len(b[p])]
    if not shared:
        raise ValueError("the two methods share no problem with scores")
    d = np.array([np.mean(a[p]) - np.mean(b[p]) for p in shared], dtype=np.float64)
    return shared, d


def bootstrap_replicates(d: np.ndarray, n_boot: int = 4000, seed: int = 0) -> np.ndarray:
    """[n_boot] means of d over problems resampled with replacement."""
    rng = np.random.default_rng(seed)
    n = len(d)
    idx = rng.integers(0, n, size=(n_boot, n))
    return d[idx].mean(axis=1)


def paired_bootstrap(a: Scores, b: Scores, *, n_boot: int = 4000, alpha: float = 0.05, seed: int = 0) -> dict:
    """Mean difference A - B over shared problems and its percentile CI."""
    shared, d = _paired(a, b)
    reps = bootstrap_replicates(d, n_boot, seed)
    lo, hi = np.percentile(reps, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "n_problems": len(shared)}


def sign_test(a: Scores, b: Scores) -> dict:
    """Exact two-sided sign test on per-problem differences (ties dropped)."""
    from scipy.stats import binomtest

    _, d = _paired(a, b)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    p = 1.0 if n == 0 else float(binomtest(pos, n, 0.5, alternative="two-sided").pvalue)
    return {"n_pos": pos, "n_neg": neg, "n_ties": int(len(d) - n), "p": p}


@dataclass
class Comparison:
    a: str
    b: str
    diff: float          # mean score A - B (per-problem means, averaged over shared problems)
    lo: float
    hi: float
    p_sign: float
    n_pos: int
    n_neg: int
    n_ties: int
    n_problems: int
    significant: bool
    direction: int       # +1 A significantly above B, -1 below, 0 not significant

    def to_dict(self) -> dict:
        return asdict(self)


def compare(a: Scores, b: Scores, *, name_a: str = "A", name_b: str = "B", n_boot: int = 4000,
            alpha: float = 0.05, seed: int = 0) -> Comparison:
    bs = paired_bootstrap(a, b, n_boot=n_boot, alpha=alpha, seed=seed)
    st = sign_test(a, b)
    ci_excludes_zero = bs["lo"] > 0 or bs["hi"] < 0
    sig = bool(ci_excludes_zero and st["p"] < alpha)
    direction = (1 if bs["diff"] > 0 else -1) if sig else 0
    return Comparison(name_a, name_b, bs["diff"], bs["lo"], bs["hi"], st["p"], st["n_pos"], st["n_neg"],
                      st["n_ties"], bs["n_problems"], sig, direction)


def pairwise(methods: Mapping[str, Scores], **kw) -> list[Comparison]:
    """Every ordered pair (A, B) with A listed before B."""
    names = list(methods)
    out = []
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            out.append(compare(methods[x], methods[y], name_a=x, name_b=y, **kw))
    return out


def run_std(per_run_accuracy: Sequence[float]) -> float:
    """Run-to-run standard deviation (sample, ddof=1; 0 for a single run)."""
    x = np.asarray(per_run_accuracy, dtype=np.float64)
    return float(x.std(ddof=1)) if len(x) > 1 else 0.0


def detectable_change(start: float, problems: int, *, seeds: int = 1, alpha: float = 0.05, power: float = 0.8,
                      direction: int = 1) -> float:
    """The smallest change of an accuracy from `start` that a paired read of `problems` problems detects with
    probability `power` at two-sided level `alpha` (normal approximation of the mean per-problem difference,
    d_i = mean over `seeds` end reads - start read). Start and end are taken as independent per problem (a
    positive correlation, as between two reads of one model, only shrinks the variance: conservative), and the
    end's `seeds` as independent reads (seeds=1: as if every seed read alike, the most conservative). `direction`
    +1 asks for a rise, -1 for a fall; 1 - start (or start) when even the largest change is not detectable."""
    from statistics import NormalDist

    if not 0 <= start <= 1 or problems < 1 or seeds < 1 or direction not in (1, -1):
        raise ValueError("start in [0, 1], problems >= 1, seeds >= 1, direction +1 or -1")
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    room = 1 - start if direction == 1 else start
    for k in range(1, 1001):                       # the first change on a 0.001 grid that the read can see
        d = room * k / 1000
        end = start + direction * d
        se = np.sqrt((start * (1 - start) + end * (1 - end) / seeds) / problems)
        if d >= z * se:
            return round(float(d), 3)
    return round(float(room), 3)
