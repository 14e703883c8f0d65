"""Random Attention with a scored reserve: needle insurance (issue #39).

Random loses what a trace states once: an unprotected entry survives a round with probability
(K − ℓp)/(K + r − ℓp), so n rounds with its n-th power (K = 512, r = 32, a short prompt: 0.94 a round, 5%
after 50 rounds); only a fact with copies in many heads and positions outlives that. The reserve gives a
few entries a seat that does not depend on the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import BUFFER_KEYS, KEYS, EvictionContext, PolicyError, VictimDrawPolicy
from .registry import register


def reserve_fraction(value, why: str = "") -> float:
    """ρ, the share of the unprotected seats a reserve policy fills by score, as a float in [0, 1), else a
    PolicyError naming the field (`why`: what 1 would mean for that policy)."""
    try:
        rho = float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"reserve must be a number in [0, 1), got {value!r}") from None
    if not 0.0 <= rho < 1.0:   # also refuses NaN
        raise PolicyError(f"reserve must be in [0, 1){why}, got {value!r}")
    return rho


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RandomReservePolicy(VictimDrawPolicy):
    """Per KV head: the protected positions (the prompt, as `random`), then the R = ⌊ρ·(K − p)⌋
    unprotected candidates with the highest score (p = `protected_len`, ρ = `reserve`), then K − p − R drawn
    uniformly (the request's generator) from the candidates neither took. ρ = 0 is `random`'s distribution.

    **The score is R-KV's redundancy term, s_i = 1 − c̄_i** (`rkv` at λ = 0: c̄_i the mean cosine of key i
    to the other candidates and the recent buffer's keys), not accumulated attention nor rkv's full score:
    * what it catches: random keeps whatever has copies elsewhere (heads, positions); the entries it
      cannot afford to lose are the ones without copies, the keys least like the rest. The measured
      difference between rkv and snapkv (the same window attention, less the redundancy term) is the needle:
      0.31 vs 0.09 at K = 256, 0.88 vs 0.50 at K = 512 (results/reasoner-eval-evict-cpu-2026-12-01.md),
      while window attention alone (snapkv, 0.50) is below random (0.58) at K = 512. And 1 − c̄_i of an
      entry moves little from round to round (the pool changes by r of ~K + r keys), so a needle holds its
      seat for the many rounds it must survive; a window score, re-voted by w fresh queries each round, does
      not. h2o (accumulated attention) scores 0.00 / 0.03 there, but it also fails the local chains (it
      drops the prompt and recency), so those numbers say little about its score.
    * cost: O((K + r)·d) per head from the candidates' and the buffer's keys, gathered at the round; no
      queries, no per-step work. Accumulated attention (`h2o`'s ATTENTION) costs the query ring and an
      fp32 attention of the r queries since the last round over K + 2r keys per layer (r = 64: 8x rkv's
      window of 8 queries) every round, and rkv's full score the window attention. Both read queries,
      which costs a served tier two things `random` has: full CUDA graphs (an engine refuses a
      query-reading default policy under cudagraph_mode FULL*, `engine/allowlist.py`) and prefix-cache
      reads (`scheduler_side.prefix_cache_caps` reads nothing for QUERIES / ATTENTION: a hit would skip
      the prefill they score). Reading keys only, this policy keeps both: like `random` it caches and reads
      the whole blocks of its protected prompt (GRPO's n samples of one prompt share them).

    Engine: not `random` itself, so no keyed draw (`victim_selection.keyed_draw`); `select_one` gathers the
    candidates' keys and the buffer's keys for every layer (stacked as rows), and the fill draws from the
    request's torch generator (seeded from `kvtier_seed`: same seed, same device type, same keep-sets).

    Replay (`kvtier.deathtime`, learner replay): the keep-sets depend on the model's keys, so
    `simulate_deaths` refuses this policy and a learner cannot re-derive them from the seed; nor would the
    reserve's keep-sets per round suffice (the fill is drawn from the request's generator, a device-specific
    stream, over what the reserve left). A sample must carry its death record, built from the engine's
    audit log (`deaths_from_rounds`). At Qwen3-4B shapes (36 layers x 8 KV heads, K = 3072, r = 128,
    32,768 tokens): dense int32 deaths 36·8·32768·4 = 37,748,736 B (37.7 MB); every entry dies at one of
    the 230 rounds (`round_positions`) or never, so a uint8 round index per entry carries the same record in
    36·8·32768 = 9,437,184 B (9.4 MB); the raw audit keep-sets would be 230·36·8·3072 uint16 positions =
    407 MB. `random` sends four integers (tests/test_policy_random_reserve.py pins this arithmetic).
    """

    name = "random_reserve"
    needs = frozenset({KEYS})
    optional = frozenset({BUFFER_KEYS})
    order_free = True           # the score is a sum over the pool, the fill a uniform draw: no neighbours
    default_protect_prompt = True

    reserve: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reserve = reserve_fraction(self.reserve, " (1 would be a scored policy without the random draw)")

    def reserve_size(self, budget: int, protected: int) -> int:
        """R = ⌊ρ·(K − p)⌋: the unprotected seats filled by score."""
        return math.floor(self.reserve * max(budget - protected, 0))

    def score(self, ctx: EvictionContext) -> Tensor:
        """[H, S] 1 − c̄ (rkv's redundancy term): higher = less like the other cached keys."""
        return 1.0 - key_redundancy(ctx.keys, ctx.buffer_keys)

    def victims(self, ctx: EvictionContext) -> Tensor:
        """[H, S − K] evicted candidates, ascending: the S − K smallest of uniform scores over the
        candidates that are neither protected nor in the reserve (a uniform (S − K)-subset of them).
        p is the policy's protected length (every head of an engine's cache holds all of it), so R is known
        on the host: nothing is read back from the device (a GPU step must not wait on it)."""
        H, S = ctx.positions.shape
        taken = self.protected_mask(ctx)
        seats = self.reserve_size(ctx.budget, self.protected_len(ctx.prompt_len))
        if seats > 0:
            top = self.score(ctx).float().masked_fill(taken, float("-inf")).topk(seats, dim=1).indices
            taken = taken.scatter(1, top, True)
        u = torch.rand((H, S), generator=ctx.generator, device=ctx.positions.device).masked_fill_(taken, 2.0)
        return u.topk(S - ctx.budget, dim=1, largest=False).indices.sort(dim=1).values



def key_redundancy(keys: Tensor, others: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """[H, S] float32 c̄_i, as `rkv.mean_key_cosine` (over the S + r keys of `keys` and `others`), in three
    reads of the keys in their own dtype: norms, then Σ_j k_j/‖k_j‖ and k_i · that sum as batched matmuls.
    mean_key_cosine converts every key to fp32 and writes its unit copy: at the bench's shapes (288 rows x
    1,088 keys x 128, bf16, one shared CPU thread) ~800 ms against ~75 ms here. On a bf16 cache the matmuls round
    to bf16 (c̄ within ~5e-3; nearer scores may swap ranks); fp32 keys give mean_key_cosine's values."""
    # bmm copies a batch-strided operand anyway (the candidates are a slice of a longer cache): copy once
    parts = [x.contiguous() for x in ([keys] if others is None else [keys, others])]
    inv = [1.0 / torch.linalg.vector_norm(x, dim=-1).float().clamp_min(eps) for x in parts]   # [H, n] each
    pool = sum(torch.bmm(w.to(x.dtype).unsqueeze(1), x) for w, x in zip(inv, parts))      # [H, 1, d] Σ k̂_j
    total = torch.bmm(parts[0], pool.transpose(1, 2)).squeeze(-1).float() * inv[0]       # k̂_i · Σ_j k̂_j
    n = sum(x.shape[1] for x in parts)
    self_term = (inv[0] < 1.0 / eps).float()                                               # k̂_i · k̂_i (0 if k_i = 0)
    return (total - self_term) / max(n - 1, 1)
