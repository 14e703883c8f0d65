"""The one interface every eviction policy implements.

A policy sees one request's cache in one layer, per KV head, and answers which candidates survive an
eviction round. Candidates are the cached positions outside the recent buffer. The caller (the schedule /
compaction code here, or the vLLM engine) gathers only what the policy declares in `needs`.

Shapes: H = KV heads (any leading row count works for policies that read nothing), S = candidates,
d = head_dim, w = window of recent queries. Candidates are in chronological order per head
(`positions[h]` ascending), except for policies with `order_free = True`, which may be given any order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor


class PolicyError(ValueError):
    """Bad policy input; the message names the offending parameter."""


# What a policy may declare it reads. The engine provides exactly these.
KEYS, VALUES, QUERIES, BUFFER_KEYS, ATTENTION = "keys", "values", "queries", "buffer_keys", "attention"
KNOWN_NEEDS = frozenset({KEYS, VALUES, QUERIES, BUFFER_KEYS, ATTENTION})


@dataclass
class EvictionContext:
    """One request, one layer, one eviction round.

    positions: [H, S] logical position of each candidate (post-eviction heads hold different sets).
    budget:    K, the candidates each head keeps.
    prompt_len: ℓp, positions < ℓp are the prompt.
    keys/values: [H, S, d] cached (post-RoPE) keys / values of the candidates.
    queries:   [H_q, w, d] the w most recent (post-RoPE) queries; H_q is a multiple of H (GQA).
    buffer_keys: [H, r, d] keys in the recent buffer (not candidates; used for softmax normalisation).
    attention: [H, S] accumulated attention each candidate received (H2O-style state).
    query_position: logical position of the newest token (for distance-based scores).
    generator: seeded torch.Generator for stochastic policies.
    """

    positions: Tensor
    budget: int
    prompt_len: int
    keys: Tensor | None = None
    values: Tensor | None = None
    queries: Tensor | None = None
    buffer_keys: Tensor | None = None
    attention: Tensor | None = None
    query_position: int | None = None
    generator: torch.Generator | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_heads(self) -> int:
        return self.positions.shape[0]

    @property
    def num_candidates(self) -> int:
        return self.positions.shape[1]


class EvictionPolicy:
    """Base class: score candidates, force-keep the protected ones, keep the top-K per head.

    Subclasses set `name`, `needs`, the protection defaults, and implement `score` (higher = keep).
    A policy that natively picks victims (e.g. `random`) overrides `evict` instead; `keep` and `evict`
    are complements of each other, so either may be implemented.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    order_free: ClassVar[bool] = False
    default_protect_prompt: ClassVar[bool] = True
    default_sinks: ClassVar[int] = 0

    def __init__(self, *, protect_prompt: bool | None = None, sinks: int | None = None,
                 protect_prefix: int | None = None) -> None:
        if protect_prefix is not None:
            if protect_prompt is False:
                raise PolicyError("protect_prefix protects the first N prompt positions; it cannot be combined "
                                  "with protect_prompt=False")
            if int(protect_prefix) < 0:
                raise PolicyError(f"protect_prefix must be >= 0, got {protect_prefix}")
            protect_prompt = True
        self.protect_prompt = self.default_protect_prompt if protect_prompt is None else bool(protect_prompt)
        # None: the whole prompt is protected when protect_prompt is on (the paper's rule); N: only the
        # first min(N, prompt_len) prompt positions are (multi-turn: the first turn; resumed partial
        # rollouts: the original prompt), the rest of the prompt are ordinary candidates.
        self.protect_prefix = None if protect_prefix is None else int(protect_prefix)
        self.sinks = self.default_sinks if sinks is None else int(sinks)
        if self.sinks < 0:
            raise PolicyError(f"sinks must be >= 0, got {self.sinks}")

    # -- configuration -------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """The policy's parameters (for logs and configs)."""
        out: dict[str, Any] = {"protect_prompt": self.protect_prompt, "sinks": self.sinks}
        if self.protect_prefix is not None:
            out["protect_prefix"] = self.protect_prefix
        return out

    def protected_len(self, prompt_len: int) -> int:
        """Positions < this are never evicted: the sinks, and the prompt (all of it, or its first
        `protect_prefix` positions) when protect_prompt is on."""
        if not self.protect_prompt:
            return self.sinks
        if self.protect_prefix is not None:
            return max(self.sinks, min(prompt_len, self.protect_prefix))
        return max(self.sinks, prompt_len)

    def check_budget(self, budget: int, prompt_len: int) -> None:
        """Raise if the budget cannot hold what this policy must protect."""
        if budget <= 0:
            raise PolicyError(f"budget must be > 0, got {budget}")
        if prompt_len < 0:
            raise PolicyError(f"prompt_len must be >= 0, got {prompt_len}")
        protected = self.protected_len(prompt_len)
        if protected > budget:
            if protected == self.sinks:
                what = "sinks"
            elif self.protect_prefix is not None:
                what = "protect_prefix"
            else:
                what = "prompt_len"
            raise PolicyError(
                f"budget={budget} cannot hold the {protected} protected positions ({what}={protected}) of "
                f"policy {self.name!r}; raise the budget, protect only the first N prompt tokens "
                f"(protect_prefix=N, N <= budget) or turn protect_prompt off"
            )

    # -- selection -----------------------------------------------------------------------------
    def score(self, ctx: EvictionContext) -> Tensor:
        raise NotImplementedError(f"policy {self.name!r} implements neither score() nor evict()")

    def protected_mask(self, ctx: EvictionContext) -> Tensor:
        return ctx.positions < self.protected_len(ctx.prompt_len)

    def keep(self, ctx: EvictionContext) -> Tensor:
        """[H, min(K, S)] candidate indices kept per head, ascending (chronological)."""
        self._validate(ctx)
        H, S = ctx.positions.shape
        if S <= ctx.budget:
            return torch.arange(S, device=ctx.positions.device).expand(H, S).clone()
        if type(self).evict is not EvictionPolicy.evict:  # native victim picker: keep = complement
            return complement(self.evict(ctx), S)
        scores = self.score(ctx)
        scores = scores.double() if scores.dtype == torch.float64 else scores.float()
        if scores.shape != (H, S):
            raise PolicyError(f"policy {self.name!r} returned scores of shape {tuple(scores.shape)}, expected {(H, S)}")
        scores = scores.masked_fill(self.protected_mask(ctx), float("inf"))
        return scores.topk(ctx.budget, dim=1).indices.sort(dim=1).values

    def evict(self, ctx: EvictionContext) -> Tensor:
        """[H, max(S - K, 0)] candidate indices evicted per head, ascending."""
        return complement(self.keep(ctx), ctx.num_candidates)

    # -- checks --------------------------------------------------------------------------------
    def _validate(self, ctx: EvictionContext) -> None:
        self.check_budget(ctx.budget, ctx.prompt_len)
        if ctx.positions.dim() != 2:
            raise PolicyError(f"positions must be [H, S], got shape {tuple(ctx.positions.shape)}")
        H, S = ctx.positions.shape
        for need in self.needs:
            if getattr(ctx, need) is None:
                raise PolicyError(f"policy {self.name!r} needs {need!r} but the context has none")
        for name in (KEYS, VALUES):
            t = getattr(ctx, name) if name in self.needs else None
            if t is not None and (t.dim() != 3 or t.shape[:2] != (H, S)):
                raise PolicyError(f"{name} must be [H={H}, S={S}, d], got shape {tuple(t.shape)}")
        if QUERIES in self.needs:
            q = ctx.queries
            if q.dim() != 3 or q.shape[0] % H != 0:
                raise PolicyError(f"queries must be [H_q, w, d] with H_q a multiple of H={H}, got {tuple(q.shape)}")
            if ctx.keys is not None and q.shape[2] != ctx.keys.shape[2]:
                raise PolicyError(f"queries head_dim {q.shape[2]} != keys head_dim {ctx.keys.shape[2]}")
        if ATTENTION in self.needs and ctx.attention.shape != (H, S):
            raise PolicyError(f"attention must be [H={H}, S={S}], got {tuple(ctx.attention.shape)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def complement(index: Tensor, size: int) -> Tensor:
    """Per row, the ascending indices in [0, size) that `index` does not name (rows have equal counts)."""
    rows = index.shape[0]
    mask = torch.ones(rows, size, dtype=torch.bool, device=index.device)
    mask.scatter_(1, index, False)
    return mask.nonzero()[:, 1].view(rows, size - index.shape[1])


def grouped_window_attention(keys: Tensor, queries: Tensor, buffer_keys: Tensor | None = None) -> Tensor:
    """[H, S]: attention the window queries put on each candidate, summed over the window and averaged
    over each KV head's query group. Softmax runs over candidates plus the buffer keys when given."""
    return window_attention(keys, queries, buffer_keys).sum(dim=2).mean(dim=1)


def window_attention(keys: Tensor, queries: Tensor, buffer_keys: Tensor | None = None) -> Tensor:
    """[H, G, w, S]: softmax attention of every window query (G = query heads per KV head) on each
    candidate. Softmax runs over candidates plus the buffer keys when given."""
    H, S, d = keys.shape
    group = queries.shape[0] // H
    q = queries.float().view(H, group * queries.shape[1], d)
    k = keys.float()
    if buffer_keys is not None:
        k = torch.cat([k, buffer_keys.float()], dim=1)
    attn = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1)[:, :, :S]  # [H, G*w, S]
    return attn.view(H, group, -1, S)


def unit_rows(x: Tensor, eps: float = 1e-8) -> Tensor:
    """x / ||x|| along the last dim (float32 or wider); all-zero rows stay zero."""
    x = x.double() if x.dtype == torch.float64 else x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def top_per_row(scores: Tensor, counts: Tensor, eligible: Tensor) -> Tensor:
    """[H, S] bool: per row h, the counts[h] eligible entries with the largest scores (ties: lower index).
    Rows with fewer than counts[h] eligible entries get all of them."""
    ranked = scores.masked_fill(~eligible, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = ranked.argsort(dim=1)
    return (rank < counts.view(-1, 1)) & eligible


class SelectionPolicy(EvictionPolicy):
    """For policies that build their keep-set directly (samplers, greedy selectors) instead of ranking
    one score: implement `keep_mask(ctx)` -> [H, S] bool with exactly K true per head, every protected
    candidate among them. Validation and the S <= K case are handled here."""

    def keep_mask(self, ctx: EvictionContext) -> Tensor:
        raise NotImplementedError

    def keep(self, ctx: EvictionContext) -> Tensor:
        self._validate(ctx)
        H, S = ctx.positions.shape
        if S <= ctx.budget:
            return torch.arange(S, device=ctx.positions.device).expand(H, S).clone()
        mask = self.keep_mask(ctx)
        if not (mask.sum(dim=1) == ctx.budget).all() or (self.protected_mask(ctx) & ~mask).any():
            raise PolicyError(f"policy {self.name!r} built a keep-set that is not K={ctx.budget} per head with the protected ones")
        return mask.nonzero()[:, 1].view(H, ctx.budget)
