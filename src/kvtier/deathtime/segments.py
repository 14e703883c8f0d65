"""A sample generated on several caches, one segment per cache: a generate call (a tool turn, a resumed partial
rollout) or what followed a preempted request's recompute.

What the engines do (vLLM's and the reference's; `kvtier.engine.scheduler_side`): a new call, or a preempted
request once resumed, starts from a cache built by a prefill over every position before it, so at the
segment's start every entry [0, start) is visible again and each is *recomputed* under full causal
attention; row start - 1 samples the segment's first token. Rounds then follow the schedule from there: decode
steps still count from the request's prompt (its cadence and protected prefix), the first round waits for no
earlier one of this cache (`EvictionSchedule.due`'s `after_round` is False again), and `random`'s keyed draw
numbers a round over the request's life (a resumed request continues its count; a new call starts at 1).

`Segment` records one stretch; `segment_deaths` gives the [layers, kv_heads, length] death times its rows
were sampled under (`simulate_deaths` from a rebuilt cache). A forward under one death tensor computes each
position's keys once, so it reproduces a multi-segment sample exactly only when no earlier segment evicted
anything before its end: then every earlier row saw full causal attention, as the recompute does, and the
last segment's deaths describe the whole sample (`one_tensor_deaths`). Otherwise the rows of an earlier
segment need its own forward over its prefix (the masked reference's one forward per segment,
`kvtier.reference.replay`): one death tensor cannot give a position both its evicted and its recomputed keys.
`forward_segments` names the segments that need such a forward; `call_segments` builds one generate call's
segments from what the engine reports, and `segments_to_json` / `segments_from_json` are the per-sample record
the rollout returns (`kvtier_segments`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .record import NEVER
from .simulate import round_positions, simulate_deaths


@dataclass(frozen=True)
class Segment:
    """Rows [start - 1, end) of a sample (the queries that sampled tokens start..end) on one cache.

    start: positions the cache held, all visible, when the segment began (a call's prompt; after a preemption,
    every token so far). prompt_len: the request's prompt (its cadence origin and protected prefix; a call's
    own prompt). rounds_before: rounds the request had applied before this cache (0 for a new call).
    seed / budget / buffer / policy / policy_params: the request's eviction (`kvtier_*` fields)."""

    start: int
    end: int
    prompt_len: int
    seed: int
    budget: int
    buffer: int
    policy: str = "random"
    policy_params: str | None = None
    rounds_before: int = 0

    def policy_schedule(self):
        from kvtier.policies import EvictionSchedule, make_policy

        params = json.loads(self.policy_params or "{}")
        return make_policy(self.policy, **params), EvictionSchedule(self.budget, self.buffer)

    def rounds(self) -> list[int]:
        """query_position of each round that applied to this segment's rows."""
        _, schedule = self.policy_schedule()
        return round_positions(schedule, self.prompt_len, self.end, self.start)


def segment_deaths(seg: Segment, length: int, num_layers: int, num_kv_heads: int) -> Tensor:
    """[layers, kv_heads, length] int32: the deaths this segment's rows were sampled under (rows outside it:
    meaningless; positions at or after `seg.end` never die)."""
    policy, schedule = seg.policy_schedule()
    d = simulate_deaths(policy, schedule, seg.prompt_len, seg.end, num_layers=num_layers, num_kv_heads=num_kv_heads,
                        seed=seg.seed, start=seg.start, rounds_before=seg.rounds_before)
    out = torch.full((num_layers, num_kv_heads, length), NEVER, dtype=torch.int32)
    out[:, :, : seg.end] = d
    return out


def collapses(segments: list[Segment]) -> bool:
    """True when one death tensor replays every segment exactly: no segment but the last ran a round."""
    return all(not s.rounds() for s in segments[:-1])


def one_tensor_deaths(segments: list[Segment], length: int, num_layers: int, num_kv_heads: int) -> Tensor | None:
    """The whole sample's deaths when `collapses`, else None (the sample needs a forward per segment)."""
    if not segments or not collapses(segments):
        return None
    return segment_deaths(segments[-1], length, num_layers, num_kv_heads)


def forward_segments(segments: list[Segment]) -> list[Segment]:
    """The segments whose rows need a forward of their own, in order: every one that ran a round, and the last.
    A segment that ran none saw full causal attention, which is what every row before a later segment's start
    sees in that segment's forward, so its rows are scored there. One entry: `one_tensor_deaths`'s case."""
    return [s for s in segments[:-1] if s.rounds()] + segments[-1:]


def call_segments(prompt_len: int, generated: int, resets: list, *, seed: int, budget: int, buffer: int,
                  policy: str = "random", policy_params: str | None = None) -> list[Segment]:
    """One generate call's segments, in the sample's positions (the call's prompt is the sample's first
    `prompt_len` tokens, as in verl's agent loops and resumed partial rollouts): the first from the prompt,
    then one after each recompute, given as [reset_row, rounds_before] (the row the resumed prefill sampled
    from, the rounds applied before it: the engine's `RequestCounters.resets`). A segment's rows end where the
    next one's begin; the call's last ends at its last generated token. Empty ones (preempted before a token
    was sampled) are left out."""
    last = int(prompt_len) + int(generated) - 1
    starts = [(int(prompt_len), 0)] + sorted((int(row) + 1, int(before)) for row, before in resets)
    out = []
    for i, (start, before) in enumerate(starts):
        end = starts[i + 1][0] - 1 if i + 1 < len(starts) else last
        if end >= start:
            out.append(Segment(start=start, end=end, prompt_len=int(prompt_len), seed=int(seed), budget=int(budget),
                               buffer=int(buffer), policy=policy, policy_params=policy_params, rounds_before=before))
    return out


def segments_to_json(segments: list[Segment]) -> str:
    return json.dumps([asdict(s) for s in segments], separators=(",", ":"))


def segments_from_json(text: str) -> list[Segment]:
    """The segments of a `segments_to_json` record; ValueError unless they are in order, each row range after
    the previous one's (rows [start - 1, end), not overlapping)."""
    segments = [Segment(**d) for d in json.loads(text)]
    for a, b in zip(segments, segments[1:]):
        if b.start - 1 < a.end:
            raise ValueError(f"segments out of order: {a} then {b}")
    if any(s.end < s.start for s in segments):
        raise ValueError(f"an empty segment in {text}")
    return segments
