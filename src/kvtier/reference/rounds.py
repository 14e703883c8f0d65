"""When the reference engine evicts (the compressed engine's schedule) and what a round evicts.

The trigger is `EvictionSchedule.due`, exactly as kvtier.engine.scheduler_side calls it; at a round every
KV head of every layer keeps K candidates (everything outside the r newest). `random` draws its victims
with the engine's counter-based keys (`keyed_random.keyed_victims`: seed, round, layer, KV head), so with
the same eviction seed both engines keep the same positions; other order-free read-nothing policies draw
once per sequence for all layers and heads from the sequence's generator.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from kvtier.deathtime import round_positions
from kvtier.engine.config import EvictionSpec
from kvtier.policies import EvictionContext
from kvtier.policies.keyed_random import keyed_victims
from kvtier.policies.random import RandomPolicy

from .cache import BatchKVCache
from .requests import SequenceState

# Policies whose rows are independent (a row = one KV head of one sequence): their rounds for several
# sequences due at the same step run as one call with B*H rows. Policies with per-(layer, head) state
# (triattention's calibration, diverse's profiles) run per sequence.
ROW_BATCHABLE = frozenset({"snapkv", "rkv", "vase", "h2o", "recency", "streaming", "random", "random_shared",
                           "random_block"})


def round_due(spec: EvictionSpec, physical: int, decoded: int, after_round: bool = False) -> bool:
    """The compressed engine's trigger (`EvictionSchedule.due`, as scheduler_side.plan calls it), checked
    before a decode step appends."""
    if not spec.compressed:
        return False
    return spec.schedule().due(physical, decoded, after_round)


def round_schedule(prompt_len: int, total_len: int, spec: EvictionSpec) -> list[int]:
    """query_position of every round a sequence of `total_len` tokens (prompt + fed tokens) goes through."""
    return round_positions(spec.schedule(), prompt_len, total_len) if spec.compressed else []


def select_evicted(cache: BatchKVCache, seqs: Sequence[SequenceState], rows: list[int], *,
                   batched_draws: bool = False) -> Tensor:
    """The slots a round evicts for `rows`, sequences that share a policy, budget and buffer, hold the same
    number of entries and are at the same prompt length and position: [L, len(rows), H, e], ascending
    per head. batched_draws: order-free read-nothing policies draw once for all rows (not engine-identical)."""
    c = cache
    s0 = seqs[rows[0]]
    spec, policy = s0.spec, s0.policy
    sched = spec.schedule()
    n = c.lengths[rows[0]]
    n_cand = sched.num_candidates(n)
    qp = s0.prompt_len + s0.decoded - 1
    base = dict(budget=sched.budget, prompt_len=s0.prompt_len, query_position=qp)
    L, H = c.L, c.H
    rows_t = torch.tensor(rows, device=c.device)
    if type(policy) is RandomPolicy:
        # the vLLM engine's draw (worker_side._select_keyed): keyed by (seed, round, layer, KV head)
        return keyed_victims(
            torch.tensor([seqs[b].evict_key for b in rows], device=c.device),
            torch.tensor([seqs[b].rounds + 1 for b in rows], device=c.device), L,
            torch.arange(H, device=c.device), torch.full((len(rows),), policy.protected_len(s0.prompt_len),
                                                         device=c.device),
            n_cand, sched.num_evicted(n)).transpose(0, 1)                      # [L, nb, H, e]
    if policy.order_free and not policy.needs and batched_draws:
        cand = c.positions[:, rows_t, :, :n_cand].reshape(L * len(rows) * H, n_cand)
        ctx = EvictionContext(positions=cand, generator=seqs[rows[0]].evict_gen, **base)
        return policy.evict(ctx).view(L, len(rows), H, -1)
    if policy.order_free and not policy.needs:
        ev = []
        for b in rows:                                      # one draw per sequence for all layers (engine-identical)
            cand = c.positions[:, b, :, :n_cand].reshape(L * H, n_cand)
            ctx = EvictionContext(positions=cand, generator=seqs[b].evict_gen, **base)
            ev.append(policy.evict(ctx).view(L, H, -1))
        return torch.stack(ev, dim=1)                       # [L, nb, H, e]
    chunks = [rows] if (policy.name in ROW_BATCHABLE and len(rows) > 1) else [[b] for b in rows]
    # what the engine hands a policy: + the buffer's keys when it reads them (optionally), and the
    # min(seen, w) newest queries, chronological
    with_buffer = "buffer_keys" in (policy.needs | getattr(policy, "optional", frozenset()))
    n_q = min(qp + 1, c.query_window) if c.queries is not None else 0
    per_chunk = []
    for chunk in chunks:
        nb = len(chunk)
        idx = torch.tensor(chunk, device=c.device)
        layers = []
        for l in range(L):
            cand = c.positions[l].index_select(0, idx)[:, :, :n_cand].reshape(nb * H, n_cand)
            order = cand.argsort(dim=1)

            def gather(t: Tensor) -> Tensor:
                t = t.index_select(0, idx)[:, :, :n_cand].reshape(nb * H, n_cand, *t.shape[3:])
                return t.gather(1, order.view(nb * H, n_cand, *([1] * (t.dim() - 2))).expand_as(t))

            ctx = EvictionContext(
                positions=cand.gather(1, order),
                keys=gather(c.keys[l]) if "keys" in policy.needs else None,
                values=gather(c.values[l]) if "values" in policy.needs else None,
                buffer_keys=(c.keys[l].index_select(0, idx)[:, :, n_cand:n].reshape(nb * H, n - n_cand, c.d)
                             if with_buffer else None),
                queries=(c.queries[l].index_select(0, idx)[:, :, c.query_window - n_q:]
                         .reshape(nb * c.Hq, n_q, c.d)
                         if "queries" in policy.needs and c.queries is not None else None),
                attention=gather(c.attention[l]) if "attention" in policy.needs and c.attention is not None else None,
                generator=seqs[chunk[0]].evict_gen,
                extras={"layer": l, "num_layers": L,
                        **({"state": seqs[chunk[0]].policy_state} if nb == 1 else {})}, **base)
            ev = order.gather(1, policy.evict(ctx)).sort(dim=1).values          # [nb*H, e]
            layers.append(ev.view(nb, H, -1))
        per_chunk.append(torch.stack(layers))                                  # [L, nb, H, e]
    return torch.cat(per_chunk, dim=1)
