"""Death times without an engine: the schedule and a policy that reads nothing, or only first-layer keys.

The trigger is `EvictionSchedule.due` (the engines' one rule); compaction is hole filling over a per-head
slot -> position map, as in both engines, because `random`'s keyed draw picks *slots*: its victims
depend on where hole filling moved the survivors. With the request's eviction seed, `random`'s records
here equal the vLLM engine's and the reference engine's keep-sets (tests/test_deathtime.py).

A policy that reads only the first layer's keys (`reads_first_layer_keys`: random_line_reserve) is replayed
from those keys (`first_layer.first_layer_keys`: they do not depend on eviction), called as the reference
engine calls it: per layer, candidates chronological, layer 0 first, one state dict per request across
rounds, every draw from one generator seeded with the eviction seed; its records then equal the reference
engine's (tests/test_deathtime_first_layer.py). The vLLM worker calls it once with every layer stacked and
seeds its generator from the seed's key, so it draws other (equally distributed) victims around the same
reserve: the anchors come from the same first-layer keys in both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kvtier.policies import EvictionContext, EvictionPolicy, EvictionSchedule
from kvtier.policies.base import BUFFER_KEYS, KEYS
from kvtier.policies.compaction import hole_fill_plan
from kvtier.policies.keyed_random import seed_key
from kvtier.policies.random import RandomPolicy

from .record import NEVER
from .store import encode


def round_positions(schedule: EvictionSchedule, prompt_len: int, length: int, start: int | None = None) -> list[int]:
    """query_position of every round a sequence of `length` positions (prompt + fed tokens) goes through.
    start: the cache was (re)built holding positions [0, start) (default: the prompt), as after a preempted
    request's recompute; decode steps still count from the prompt (`prompt_len`), as in the engines."""
    start = prompt_len if start is None else start
    out, physical = [], start
    for p in range(start, length):
        if schedule.due(physical, p - prompt_len, bool(out)):
            out.append(p - 1)
            physical = schedule.settled_len
        physical += 1
    return out


def round_shapes(schedule: EvictionSchedule, prompt_len: int, length: int,
                 start: int | None = None) -> list[tuple[int, int, int, int]]:
    """(query_position, cached entries at the round, candidates, evicted) of every round, in order."""
    start = prompt_len if start is None else start
    out, physical, appended = [], start, start
    for qp in round_positions(schedule, prompt_len, length, start):
        physical += qp + 1 - appended                    # the positions decoded since: one slot each
        appended = qp + 1
        e = schedule.num_evicted(physical)
        out.append((qp, physical, schedule.num_candidates(physical), e))
        physical -= e
    return out


def reads_first_layer_keys(policy: EvictionPolicy) -> bool:
    """True for a policy whose evictions are a function of positions, its draw and the first layer's keys
    alone (its class says so: `first_layer_keys_only`), which `simulate_deaths` replays given those keys."""
    return bool(getattr(policy, "first_layer_keys_only", False)) and policy.needs <= {KEYS, BUFFER_KEYS}


def simulate_deaths(policy: EvictionPolicy, schedule: EvictionSchedule, prompt_len: int, length: int, *,
                    num_layers: int, num_kv_heads: int, seed: int, heads: Tensor | None = None,
                    start: int | None = None, rounds_before: int = 0, first_keys: Tensor | None = None) -> Tensor:
    """[layers, kv_heads, length] int32 death times of one sample under `policy` at `schedule`.

    seed: the request's eviction seed (`kvtier_seed`). heads: the global KV head index of each head
    (tensor parallelism: the engine keys random's draw by global head; default 0..kv_heads-1).
    start, rounds_before: a cache rebuilt holding [0, start), every entry visible, after `rounds_before` rounds
    (a preempted request's recompute: `kvtier.deathtime.segments`); defaults: the prompt, none.
    first_keys: [kv_heads, >= length, head_dim] the sample's first-layer keys (`first_layer.first_layer_keys`),
    for a policy that reads only those (`reads_first_layer_keys`; the module docstring says how it is called);
    not with a rebuilt cache (the engines' per-request state across a recompute is not modelled).
    Otherwise only policies that read nothing from the cache (`needs` empty) can be simulated. `random` (the
    learner replay's case) runs compiled, row by row (`keyed_deaths`, numba); the others every row at once
    per round."""
    return _simulate(policy, schedule, prompt_len, length, num_layers, num_kv_heads, seed, heads, start,
                     rounds_before, encoded=False, first_keys=first_keys)


def simulate_encoded(policy: EvictionPolicy, schedule: EvictionSchedule, prompt_len: int, length: int, *,
                     num_layers: int, num_kv_heads: int, seed: int, heads: Tensor | None = None,
                     start: int | None = None, rounds_before: int = 0,
                     first_keys: Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`simulate_deaths` in the store's compact form (`store.encode`: the round index of each entry's death,
    [NEVER] + each round's death time); `random`'s is written in that form directly (a quarter of the bytes,
    no dense tensor to encode)."""
    return _simulate(policy, schedule, prompt_len, length, num_layers, num_kv_heads, seed, heads, start,
                     rounds_before, encoded=True, first_keys=first_keys)


def _simulate(policy, schedule, prompt_len, length, L, H, seed, heads, start, rounds_before, encoded, first_keys):
    if first_keys is not None:
        _check_first_keys(policy, first_keys, H, length, prompt_len, start, rounds_before)
    elif policy.needs:
        hint = " or pass its first_keys" if reads_first_layer_keys(policy) else ""
        raise ValueError(f"policy {policy.name!r} reads {sorted(policy.needs)} from the cache: its evictions "
                         f"depend on the model; record them from an engine (deaths_from_rounds){hint}")
    policy.check_budget(schedule.budget, prompt_len)
    heads = torch.arange(H) if heads is None else heads
    start = prompt_len if start is None else int(start)
    shapes = round_shapes(schedule, prompt_len, length, start)
    table = np.asarray([NEVER] + [qp + 1 for qp, *_ in shapes], dtype=np.int32)
    if type(policy) is not RandomPolicy:
        deaths = _generic_deaths(policy, schedule, shapes, prompt_len, length, L, H, seed, start, first_keys)
        return encode(deaths, table[1:].tolist()) if encoded else deaths
    from .keyed_deaths import keyed_deaths           # numba: only `random` needs it

    out = keyed_deaths(shapes, request_key=seed_key(seed), rounds_before=rounds_before, layers=L, heads=heads,
                       low=policy.protected_len(prompt_len), start=start, length=length,
                       table=None if encoded else table)
    return (out.reshape(L, H, length), table) if encoded else torch.from_numpy(out).view(L, H, length)


def _check_first_keys(policy, first_keys, H, length, prompt_len, start, rounds_before) -> None:
    if not reads_first_layer_keys(policy):
        raise ValueError(f"policy {policy.name!r} reads {sorted(policy.needs) or 'nothing'} from the cache, not "
                         "only the first layer's keys: first_keys cannot replay it")
    if (start is not None and start != prompt_len) or rounds_before:
        raise ValueError("first_keys: a rebuilt cache (start, rounds_before) is not simulated")
    if first_keys.dim() != 3 or first_keys.shape[0] != H or first_keys.shape[1] < length:
        raise ValueError(f"first_keys must be [kv_heads={H}, >= {length}, head_dim], got {tuple(first_keys.shape)}")


def _generic_deaths(policy, schedule, shapes, prompt_len, length, L, H, seed, start, first_keys=None) -> Tensor:
    """The policies that read positions per (layer, head), or first-layer keys: every row goes through a
    round at once (per layer where the policy reads keys)."""
    R = L * H
    # The state is numpy: its fancy indexing moves [rows, e] index sets several times faster than torch's CPU
    # gather / scatter. rows[i, slot] holds the flat index into `deaths` of the position in that slot
    # (i * length + position), so one read of the victims' slots gives where their deaths go.
    deaths = np.full(R * length, NEVER, dtype=np.int32)
    cap = max(schedule.max_cached, start) + 1
    base = np.arange(R, dtype=np.int64)[:, None]
    rows = np.zeros((R, cap), dtype=np.int64)
    rows[:, :start] = base * length + np.arange(start)       # a (re)built cache: chronological slots
    row_at, slot_at = base * length, base * cap
    flat = rows.reshape(-1)
    gen = torch.Generator().manual_seed(int(seed))     # the reference engine's evict_gen
    state: dict = {}                                   # the policy's per-request state (SequenceState.policy_state)
    appended = start
    for qp, n, n_cand, e in shapes:
        rows[:, n - (qp + 1 - appended) : n] = row_at + np.arange(appended, qp + 1)
        appended = qp + 1
        slots = torch.from_numpy(rows[:, :n] - row_at).view(L, H, n)
        victims = _victims(policy, schedule, slots, n, prompt_len, qp, gen, first_keys, state).reshape(R, e).numpy()
        deaths[flat[victims + slot_at]] = qp + 1                      # the victims die at qp + 1
        src, dst = _hole_fill(victims, n)
        flat[dst + slot_at] = flat[src + slot_at]
    return torch.from_numpy(deaths).view(L, H, length)


def _hole_fill(victims: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) slots of `hole_fill_plan` for [rows, e] ascending victims of a cache of n entries. When no
    victim lies in the tail [n - e, n) (the r newest are never candidates, so whenever e <= r) that plan is
    the tail in order onto the holes in order, written here; otherwise hole_fill_plan itself."""
    e = victims.shape[1]
    if e == 0 or int(victims[:, -1].max()) < n - e:
        return np.arange(n - e, n), victims
    plan = hole_fill_plan(torch.from_numpy(victims), n)
    return plan.src.numpy(), plan.dst.numpy()


def _victims(policy, schedule, slots, n, prompt_len, qp, gen, first_keys=None, state=None) -> Tensor:
    """[L, H, e] evicted slots, ascending per head, exactly as the engines choose them (not `random`); with
    first_keys, as the reference engine's `rounds.select_evicted` does for a policy that reads keys."""
    L, H, _ = slots.shape
    n_cand, e = schedule.num_candidates(n), schedule.num_evicted(n)
    base = dict(budget=schedule.budget, prompt_len=prompt_len, query_position=qp, generator=gen)
    if policy.order_free and first_keys is None:         # one draw for every layer and head, slot order
        ctx = EvictionContext(positions=slots[:, :, :n_cand].reshape(L * H, n_cand), **base)
        return policy.evict(ctx).view(L, H, e)
    out = []
    for l in range(L):                                   # chronological candidates, per layer
        cand = slots[l, :, :n_cand]
        order = cand.argsort(dim=1)
        chrono = cand.gather(1, order)
        extras, reads = {"layer": l, "num_layers": L}, {}
        if first_keys is not None:
            # The first layer's keys of this layer's candidates and of the buffer (its r newest positions,
            # qp - r + 1 .. qp: a round's candidates are older); the policy reads layer 0's call (the
            # first of the round) and reuses its anchors from `state` for the others.
            T, d = first_keys.shape[1:]
            rows = (chrono + torch.arange(H).unsqueeze(1) * T).view(-1)       # row selection: ~10x a gather's speed
            reads = dict(keys=first_keys.reshape(H * T, d).index_select(0, rows).view(H, n_cand, d),
                         buffer_keys=first_keys[:, qp + 1 - (n - n_cand) : qp + 1])
            extras["state"] = state
        ctx = EvictionContext(positions=chrono, extras=extras, **reads, **base)
        out.append(order.gather(1, policy.evict(ctx)).sort(dim=1).values)
    return torch.stack(out)
