"""Elastic budgets (issue #37): which running requests give back blocks when the engine runs short.

An elastic request (`kvtier_budget: elastic`, `kvtier_floor: K_min`) runs at full attention. Before each
step the scheduler (scheduler_side.SchedulerEviction.relieve) estimates the blocks this step needs: every
running request's next tokens, and the next waiting request's prompt when a seat is free. Where the free
pool falls short, it tightens running elastic requests to their floors, **the fewest that free enough,
largest first**, and compacts them in the same step, before vLLM allocates: vLLM then finds the blocks and
neither preempts nor leaves the waiting request out. Only when every elastic request is at its floor (or
none can free a block) does vLLM's own preemption run.

A request is tightened at most once, straight to its floor: one round from a chronological cache (the
catch-up clause of policies/schedule.py: K + 2r or more entries compact at once to K + r), then the floor's
schedule. Budgets never rise again inside a request: a cache that dropped entries cannot get them back, and
a budget that rose would only hold newer tokens, so the memory is better given to the next request. Each
tightening is a round in the audit log (its budget, query position and keep-sets), so the reference engine
replays it exactly like any other round.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A running elastic request not yet tightened: `held` blocks now, `after` blocks once at its floor."""

    req_id: str
    held: int
    after: int

    @property
    def frees(self) -> int:
        return max(0, self.held - self.after)


def choose(candidates: list[Candidate], shortage: int, *, all_or_nothing: bool = False) -> list[str]:
    """The requests to tighten for `shortage` blocks: largest `frees` first (which is also the fewest
    requests), ties by request id (deterministic). Not enough in all: every candidate that frees a block,
    or none with `all_or_nothing` (admission: a waiting request that would not fit anyway costs nobody)."""
    if shortage <= 0:
        return []
    ordered = sorted((c for c in candidates if c.frees > 0), key=lambda c: (-c.frees, c.req_id))
    out, freed = [], 0
    for c in ordered:
        if freed >= shortage:
            break
        out.append(c.req_id)
        freed += c.frees
    if freed < shortage and all_or_nothing:
        return []
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
