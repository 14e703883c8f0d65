"""Random Attention with a reserve for once-stated lines (issue #63 item 1).

§5.3: random loses what a trace states once. On the long reasoner a needle needs its whole line in every
head (docs/reasoner.md, the key-line probe), and `random_reserve`'s per-head score of every candidate every
round is ~13x random's round. This policy scores each token once, when it enters the recent buffer, from
the first layer's keys, keeps the best few as anchors with their line in every layer and KV head, and
draws the rest uniformly, as random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import BUFFER_KEYS, KEYS, EvictionContext, PolicyError, VictimDrawPolicy
from .random import sample_free
from .random_reserve import reserve_fraction
from .registry import register


@register
@dataclass(kw_only=True, eq=False, repr=False)
class RandomLineReservePolicy(VictimDrawPolicy):
    """Per KV head: the protected positions (the prompt, as `random`), the reserved lines (the same
    positions in every layer and head), then a uniform draw from the request's generator over the rest.

    **Anchors, scored once at write time.** A token is scored at the first round after it was written,
    while it is in the recent buffer: novelty = 1 − the largest cosine between its first-layer key and
    the other keys of that buffer (its r − 1 write-time neighbours), averaged over the first layer's KV
    heads. A first-layer key depends only on the token and its position (RoPE rotates it), so a high
    novelty means the token does not recur among its neighbours: a once-stated token. Within a buffer only
    local maxima (±`span`) are candidates; the request keeps the m best over all its rounds (a token
    not among the best m now never will be, so m scores are all the state holds).

    **Reserve.** Each anchor keeps itself and `span` neighbours each side (its line, without token ids), in
    every layer and KV head: m = max(1, ⌊ρ·(K − p)/(2·span + 1)⌋) anchors (p = `protected_len`, ρ =
    `reserve`; none when ρ = 0 or one span does not fit K − p), so at most m·(2·span + 1) ≤ K − p seats.
    The K − p − (reserved) other seats are a uniform draw over the remaining candidates (`sample_free`);
    ρ = 0 is random's distribution.

    Chosen on the `chains-long` selection split (8 needle problems, reasoner-long's keys, teacher forced;
    never held-out ones): the key line's `k` is the most novel trace token in 7 of 8 (0.63-0.66, every
    other token <= 0.55 except the last line's in one trace, 0.65) and the second in the eighth; the last
    layer alone ranks it 74th-474th, the all-layer average first or second by a margin of 0.01-0.06 (the
    first layer's: 0.10-0.17). Trace lines are 5-10 tokens, so ±5 around an anchor holds its line from
    either end.

    State: the engines keep one dict per request across rounds and pass it as ctx.extras["state"] (the
    vLLM worker's `WorkerRequest.extras`, the reference engine's `SequenceState.policy_state`). The first
    call of a round (query_position) scores; a later call of the same round (the reference engine's
    layers 1..L−1) reuses its anchors. Rows: with ctx.extras["layer"], one layer's heads; else
    ctx.extras["num_layers"] layers stacked (row l·H + h, the vLLM worker's layout; with tensor parallelism
    each rank's own first-layer heads). Without a state every call scores every unprotected candidate
    afresh (correct, O(S) instead of O(r)).

    Cost per round: the first layer's r buffer keys (an [H, r, r] cosine), a position table and the draw;
    the other rows' keys are not read (the first round, or a lost state, scores the unscored candidates
    once). The vLLM worker still gathers every candidate's keys for policies that need KEYS.

    Assumes the engines' schedule: a round's candidates are older than its buffer (positions <= qp − r).
    Replay: the keep-sets depend on the model's first-layer keys only (`first_layer_keys_only`), which do
    not depend on eviction: `simulate_deaths(..., first_keys=...)` replays them from those keys
    (kvtier.deathtime.first_layer), as the reference engine chooses them.
    """

    name = "random_line_reserve"
    needs = frozenset({KEYS, BUFFER_KEYS})
    order_free = True           # positions, not slot order, identify the lines; the fill is a uniform draw
    first_layer_keys_only = True   # with a state, no other layer's keys are read (deathtime.simulate replays it)
    default_protect_prompt = True

    reserve: float = 0.1
    span: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reserve = reserve_fraction(self.reserve)
        if isinstance(self.span, bool) or not isinstance(self.span, (int, float)) or self.span != int(self.span) \
                or self.span < 0:
            raise PolicyError(f"span must be an integer >= 0, got {self.span!r}")
        self.span = int(self.span)

    @property
    def width(self) -> int:
        """Positions one anchor reserves: itself and `span` each side."""
        return 2 * self.span + 1

    def num_anchors(self, budget: int, protected: int) -> int:
        """m = max(1, ⌊ρ·(K − p)/(2·span + 1)⌋), 0 when ρ = 0 or one span does not fit K − p."""
        room = max(budget - protected, 0)
        if self.reserve == 0.0 or room < self.width:
            return 0
        return max(1, math.floor(self.reserve * room / self.width))

    # -- selection -----------------------------------------------------------------------------
    def victims(self, ctx: EvictionContext) -> Tensor:
        """[H, S − K] victims, ascending: S − K uniform among the candidates neither protected nor reserved."""
        H, S = ctx.positions.shape
        qp, r = self._round(ctx)
        prot = self.protected_len(ctx.prompt_len)
        reserved = self.reserved_positions(ctx)                       # [m, width], −1 = none
        taken = torch.zeros(qp + 2, dtype=torch.bool, device=ctx.positions.device)   # by position; qp + 1: a dump
        taken[: min(prot, qp + 1)] = True
        taken.scatter_(0, torch.where(reserved >= 0, reserved, qp + 1).reshape(-1), True)
        n_free_min = S - prot - reserved.numel()
        return sample_free(ctx.positions, taken, S - ctx.budget, n_free_min, ctx.generator)

    def reserved_positions(self, ctx: EvictionContext) -> Tensor:
        """[m, 2·span + 1] the positions this round reserves (candidates only), −1 where none; the anchors
        are updated from the tokens not yet scored first (once per round: see the class docstring)."""
        qp, r = self._round(ctx)
        state = ctx.extras.get("state")
        mine = {} if state is None else state.setdefault(self.name, {})
        if mine.get("round") != qp:
            self._score_new(ctx, mine, qp, r)
        pos, score = mine["pos"], mine["score"]
        spans = pos.unsqueeze(1) + torch.arange(-self.span, self.span + 1, device=pos.device)
        ok = (score > float("-inf")).unsqueeze(1) & (spans >= self.protected_len(ctx.prompt_len)) & (spans <= qp - r)
        return torch.where(ok, spans, -1)

    # -- anchors -------------------------------------------------------------------------------
    def _round(self, ctx: EvictionContext) -> tuple[int, int]:
        """(query_position, r): the buffer holds positions qp − r + 1 .. qp, the candidates the rest."""
        r = ctx.buffer_keys.shape[1]
        qp = ctx.query_position if ctx.query_position is not None else int(ctx.positions.max()) + r
        return int(qp), r

    def _first_layer_rows(self, ctx: EvictionContext) -> int:
        H = ctx.num_heads
        layers = 1 if "layer" in ctx.extras else int(ctx.extras.get("num_layers") or 1)
        if H % layers:
            raise PolicyError(f"{H} rows are not {layers} stacked layers (ctx.extras['num_layers'])")
        return H // layers

    def _score_new(self, ctx: EvictionContext, mine: dict, qp: int, r: int) -> None:
        """Score positions lo..qp (not yet scored, unprotected) and merge their local maxima into the
        m best anchors. lo = qp − r + 1 on the steady cadence (the buffer); lower on a first round."""
        dev = ctx.positions.device
        m = self.num_anchors(ctx.budget, self.protected_len(ctx.prompt_len))
        pos = mine.get("pos", torch.empty(0, dtype=torch.long, device=dev))
        score = mine.get("score", torch.empty(0, device=dev))
        lo = max(mine.get("seen", -1) + 1, self.protected_len(ctx.prompt_len))
        if m > 0 and lo <= qp:
            new = window_novelty(*self._new_keys(ctx, lo, qp, r), r)                 # [qp − lo + 1]
            pooled = F.max_pool1d(new.view(1, 1, -1), self.width, stride=1, padding=self.span).view(-1)
            new = torch.where(new >= pooled, new, float("-inf"))                     # local maxima only
            top = new.topk(min(m, new.numel()))
            pos, score = torch.cat([pos, top.indices + lo]), torch.cat([score, top.values])
        best = score.topk(min(m, score.numel())).indices
        mine.update(pos=pos[best], score=score[best], seen=max(qp, mine.get("seen", -1)), round=qp)

    def _new_keys(self, ctx: EvictionContext, lo: int, qp: int, r: int) -> tuple[Tensor, Tensor]:
        """([h, n, d] float32 first-layer keys of positions lo..qp, [h, n] present), n = qp − lo + 1: the
        buffer's, and the candidates' for positions below it (scattered by position: any slot order)."""
        h = self._first_layer_rows(ctx)
        n, buf_lo = qp - lo + 1, qp - r + 1
        d = ctx.buffer_keys.shape[2]
        keys = torch.zeros(h, n + 1, d, device=ctx.positions.device)                # slot n: a dump
        present = torch.zeros(h, n + 1, dtype=torch.bool, device=ctx.positions.device)
        b0 = max(lo, buf_lo)
        keys[:, b0 - lo : n] = ctx.buffer_keys[:h, b0 - buf_lo :].float()
        present[:, b0 - lo : n] = True
        if lo < buf_lo:                                 # never-scored candidates: a first round, a lost state
            p = ctx.positions[:h]
            idx = torch.where((p >= lo) & (p < buf_lo), p - lo, n)
            keys.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, d), ctx.keys[:h].float())
            present.scatter_(1, idx, True)
        return keys[:, :n], present[:, :n]


def window_novelty(keys: Tensor, present: Tensor, r: int, eps: float = 1e-8) -> Tensor:
    """[n] novelty of each of n consecutive positions: 1 − the largest cosine of its key to another present
    key of its window, averaged over the heads that hold it (−inf where none does). keys [h, n, d],
    present [h, n]; windows of r positions end at the last (the buffers of the rounds), the first one
    shorter. A key without a present neighbour has novelty 0."""
    h, n, d = keys.shape
    pad = (-n) % r
    u = F.pad(keys, (0, 0, pad, 0))
    u = (u / torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(eps)).view(h, -1, r, d)
    have = F.pad(present, (pad, 0)).view(h, -1, r)
    cos = u @ u.transpose(-1, -2)                                                   # [h, windows, r, r]
    pair = have.unsqueeze(-1) & have.unsqueeze(-2) & ~torch.eye(r, dtype=torch.bool, device=keys.device)
    best = cos.masked_fill(~pair, float("-inf")).amax(dim=-1)
    nov = torch.where(best > float("-inf"), 1.0 - best, 0.0).masked_fill(~have, 0.0).reshape(h, -1)[:, pad:]
    count = present.sum(dim=0)
    return torch.where(count > 0, nov.sum(dim=0) / count.clamp_min(1), float("-inf"))
