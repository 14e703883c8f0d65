"""Death times without an engine: the schedule and a policy that reads nothing.

The trigger is `EvictionSchedule.due` (the engines' one rule); compaction is hole filling over a per-head
slot -> position map, as in both engines, because `random`'s keyed draw picks *slots*: its victims
depend on where hole filling moved the survivors. With the request's eviction seed, `random`'s records
here equal the vLLM engine's and the reference engine's keep-sets (tests/test_deathtime.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtier.policies import EvictionContext, EvictionPolicy, EvictionSchedule
from kvtier.policies.compaction import hole_fill_plan
from kvtier.policies.keyed_random import keyed_victims, seed_key
from kvtier.policies.random import RandomPolicy

from .record import NEVER


def round_positions(schedule: EvictionSchedule, prompt_len: int, length: int) -> list[int]:
    """query_position of every round a sequence of `length` positions (prompt + fed tokens) goes through."""
    out, physical = [], prompt_len
    for p in range(prompt_len, length):
        if schedule.due(physical, p - prompt_len, bool(out)):
            out.append(p - 1)
            physical = schedule.settled_len
        physical += 1
    return out


def simulate_deaths(policy: EvictionPolicy, schedule: EvictionSchedule, prompt_len: int, length: int, *,
                    num_layers: int, num_kv_heads: int, seed: int, heads: Tensor | None = None) -> Tensor:
    """[layers, kv_heads, length] int32 death times of one sample under `policy` at `schedule`.

    seed: the request's eviction seed (`kvtier_seed`). heads: the global KV head index of each head
    (tensor parallelism: the engine keys random's draw by global head; default 0..kv_heads-1).
    Only policies that read nothing from the cache (`needs` empty) can be simulated."""
    if policy.needs:
        raise ValueError(f"policy {policy.name!r} reads {sorted(policy.needs)} from the cache: its evictions "
                         "depend on the model; record them from an engine (deaths_from_rounds)")
    policy.check_budget(schedule.budget, prompt_len)
    L, H = num_layers, num_kv_heads
    heads = torch.arange(H) if heads is None else heads
    deaths = torch.full((L, H, length), NEVER, dtype=torch.int32)
    cap = max(schedule.max_cached, prompt_len) + 1
    slots = torch.full((L, H, cap), -1, dtype=torch.long)         # slot -> logical position
    slots[:, :, :prompt_len] = torch.arange(prompt_len)
    key = torch.tensor([seed_key(seed)])
    gen = torch.Generator().manual_seed(int(seed))
    physical, appended = prompt_len, prompt_len          # entries cached, positions appended so far
    for round_index, qp in enumerate(round_positions(schedule, prompt_len, length), start=1):
        count = qp + 1 - appended                        # the positions decoded since: one slot each
        slots[:, :, physical : physical + count] = torch.arange(appended, qp + 1)
        physical, appended = physical + count, qp + 1
        victims = _victims(policy, schedule, slots, physical, prompt_len, qp, key, round_index, heads, gen)
        dead = slots.gather(2, victims)                               # [L, H, e] positions
        deaths.scatter_(2, dead, torch.full(dead.shape, qp + 1, dtype=torch.int32))
        for l in range(L):
            plan = hole_fill_plan(victims[l], physical)
            slots[l].scatter_(1, plan.dst, slots[l].gather(1, plan.src))
        physical -= victims.shape[-1]
        slots[:, :, physical:] = -1
    return deaths


def _victims(policy, schedule, slots, n, prompt_len, qp, key, round_index, heads, gen) -> Tensor:
    """[L, H, e] evicted slots, ascending per head, exactly as the engines choose them."""
    L, H, _ = slots.shape
    n_cand, e = schedule.num_candidates(n), schedule.num_evicted(n)
    if type(policy) is RandomPolicy:                     # the engines' keyed draw (worker_side / reference)
        return keyed_victims(key, torch.tensor([round_index]), L, heads,
                             torch.tensor([policy.protected_len(prompt_len)]), n_cand, e)[0]
    base = dict(budget=schedule.budget, prompt_len=prompt_len, query_position=qp, generator=gen)
    if policy.order_free:                                # one draw for every layer and head, slot order
        ctx = EvictionContext(positions=slots[:, :, :n_cand].reshape(L * H, n_cand), **base)
        return policy.evict(ctx).view(L, H, e)
    out = []
    for l in range(L):                                   # chronological candidates, per layer
        cand = slots[l, :, :n_cand]
        order = cand.argsort(dim=1)
        ctx = EvictionContext(positions=cand.gather(1, order), extras={"layer": l, "num_layers": L}, **base)
        out.append(order.gather(1, policy.evict(ctx)).sort(dim=1).values)
    return torch.stack(out)
