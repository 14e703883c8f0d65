"""The one interface every eviction policy implements.

A policy sees one request's cache in one layer, per KV head, and answers which candidates survive an
eviction round. Candidates are the cached positions outside the recent buffer. The caller (the schedule /
compaction code here, or the vLLM engine) gathers only what the policy declares in `needs`.

Shapes: H = KV heads (any leading row count works for policies that read nothing), S = candidates,
d = head_dim, w = window of recent queries. Candidates are in chronological order per head
(`positions[h]` ascending), except for policies with `order_free = True`, which may be given any order.
Tensor helpers the policies share (window attention, unit rows, ...) are in `scoring.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from .scoring import complement


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
    queries:   [H_q, w, d] the w most recent (post-RoPE) queries, chronological, the newest the query of the
               token at query_position; H_q is a multiple of H (GQA).
    buffer_keys: [H, r, d] keys in the recent buffer, chronological, the newest the key of the token at
               query_position (not candidates; used for softmax normalisation and as causal context).
    attention: [H, S] accumulated attention each candidate received (H2O-style state).
    query_position: logical position of the newest token (distance-based scores, causal window masks).
    generator: seeded torch.Generator for stochastic policies.
    extras:    what else the caller knows: the engines pass `num_layers` (rows are that many layers stacked,
               row l·H + h) or `layer` (one layer's heads), and `state`, a dict the engine keeps per request
               across rounds (a policy keeps its own state under its name: random_line_reserve).
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


# Field metadata (dataclasses.field(metadata=...)) read by `EvictionPolicy.params`.
NOT_A_PARAM = {"param": False}        # a constructor argument that is not a parameter (e.g. a loaded file)
OMIT_IF_NONE = {"omit_if_none": True}  # listed in params() only when set


@dataclass(kw_only=True, eq=False, repr=False)
class EvictionPolicy:
    """Base class: score candidates, force-keep the protected ones, keep the top-K per head.

    Subclasses set `name`, `needs`, the protection defaults, and implement `score` (higher = keep).
    A policy that natively picks victims (e.g. `random`) overrides `evict` instead; `keep` and `evict`
    are complements of each other, so either may be implemented.

    Every policy is a dataclass (keyword-only, identity equality): its fields are its parameters, set by
    `make_policy(name, **params)` and validated / normalised in `__post_init__` (subclasses call
    `super().__post_init__()` first). `params()` and `repr` are derived from the fields.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    optional: ClassVar[frozenset[str]] = frozenset()  # read when given (the engines provide BUFFER_KEYS)
    order_free: ClassVar[bool] = False
    default_protect_prompt: ClassVar[bool] = True
    default_sinks: ClassVar[int] = 0

    # None: the class default (default_protect_prompt / default_sinks); resolved in __post_init__.
    protect_prompt: bool | None = None
    sinks: int | None = None
    # None: the whole prompt is protected when protect_prompt is on (the paper's rule); N: only the
    # first min(N, prompt_len) prompt positions are (multi-turn: the first turn; resumed partial
    # rollouts: the original prompt), the rest of the prompt are ordinary candidates.
    protect_prefix: int | None = field(default=None, metadata=OMIT_IF_NONE)

    def __post_init__(self) -> None:
        if self.protect_prefix is not None:
            if self.protect_prompt is False:
                raise PolicyError("protect_prefix protects the first N prompt positions; it cannot be combined "
                                  "with protect_prompt=False")
            if int(self.protect_prefix) < 0:
                raise PolicyError(f"protect_prefix must be >= 0, got {self.protect_prefix}")
            self.protect_prompt = True
        self.protect_prompt = self.default_protect_prompt if self.protect_prompt is None else bool(self.protect_prompt)
        self.protect_prefix = None if self.protect_prefix is None else int(self.protect_prefix)
        self.sinks = self.default_sinks if self.sinks is None else int(self.sinks)
        if self.sinks < 0:
            raise PolicyError(f"sinks must be >= 0, got {self.sinks}")

    # -- configuration -------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """The policy's parameters (for logs and configs): its dataclass fields in definition order
        (base fields first), less those marked NOT_A_PARAM and unset OMIT_IF_NONE ones."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("param", True) and not (value is None and f.metadata.get("omit_if_none")):
                out[f.name] = value
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


@dataclass(kw_only=True, eq=False, repr=False)
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


@dataclass(kw_only=True, eq=False, repr=False)
class VictimDrawPolicy(SelectionPolicy):
    """For selection policies that draw their victims directly (the reserve policies: a uniform draw among the
    candidates neither protected nor reserved): implement `victims(ctx)` -> [H, S - K] ascending; the keep mask
    (checked by `keep`) and `evict` (what hole filling consumes, straight from the draw) come from it."""

    def victims(self, ctx: EvictionContext) -> Tensor:
        raise NotImplementedError

    def keep_mask(self, ctx: EvictionContext) -> Tensor:
        keep = torch.ones(ctx.positions.shape, dtype=torch.bool, device=ctx.positions.device)
        return keep.scatter_(1, self.victims(ctx), False)

    def evict(self, ctx: EvictionContext) -> Tensor:
        self._validate(ctx)
        H, S = ctx.positions.shape
        if S <= ctx.budget:
            return torch.empty(H, 0, dtype=torch.long, device=ctx.positions.device)
        return self.victims(ctx)
