"""Which path the RL learner takes for one sample, read off the per-sample fields the rollout returned.

`replay_status(fields)` is one of STATUSES: `replayed` (a record the learner re-derives and replays), `full`
(full attention), `rebuilt` (preempted and recomputed mid-generation, without a segment record), `multi_call`
(several generate calls, without a segment record), `policy` (a policy that reads the cache), `no_record` (not
kvtier's agent-loop manager). The rollout's metrics (`rollout.metrics`) and the learner's shares
(`learner_replay`) both count by it. A rebuilt or multi-call sample is `replayed` when it carries
`kvtier_segments` (`kvtier.deathtime.segments`: one segment per cache, each derivable exactly): the learner
then scores it segment by segment (`by_segment`, `replay_segments`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

REPLAYABLE_POLICIES = ("random",)       # policies whose records are re-derived (and tested equal to the engine's)
STATUSES = ("replayed", "full", "rebuilt", "multi_call", "policy", "no_record")
FIELDS = ("kvtier_budget", "kvtier_seed", "kvtier_buffer", "kvtier_policy", "kvtier_policy_params",
          "kvtier_preemptions", "kvtier_generate_calls", "kvtier_segments")


def needs_segments(fields: Mapping[str, Any]) -> bool:
    """Generated on more than one cache: preempted and recomputed, or several generate calls."""
    return int(fields.get("kvtier_preemptions") or 0) > 0 or int(fields.get("kvtier_generate_calls") or 0) > 1


def segment_record(fields: Mapping[str, Any]):
    """The sample's segments (`kvtier.deathtime.segments.Segment`, in order), or None: no record, or one that
    does not parse or is out of order."""
    text = fields.get("kvtier_segments")
    return _parsed_segments(str(text)) if text else None


@lru_cache(maxsize=8192)
def _parsed_segments(text: str):
    """The record parsed once (the status, the row list and every micro-batch's forward all ask): a tuple of
    frozen Segments, so a cached answer cannot be changed by a caller."""
    from kvtier.deathtime.segments import segments_from_json

    try:
        segments = segments_from_json(text)
    except (ValueError, TypeError, KeyError):
        return None
    return tuple(segments) or None


def replay_status(fields: Mapping[str, Any]) -> str:
    """How the learner scores one sample, from its per-sample fields (one of STATUSES)."""
    if fields.get("kvtier_budget") is None:
        return "full"
    if fields.get("kvtier_seed") is None or fields.get("kvtier_generate_calls") is None:
        return "no_record"
    policies = {fields.get("kvtier_policy")}
    if needs_segments(fields):
        segments = segment_record(fields)
        if segments is None:
            return "rebuilt" if int(fields.get("kvtier_preemptions") or 0) > 0 else "multi_call"
        policies |= {s.policy for s in segments}
    if not policies <= set(REPLAYABLE_POLICIES):
        return "policy"
    return "replayed"


def by_segment(fields: Mapping[str, Any]) -> bool:
    """A `replayed` sample the learner scores by its segments (a forward per segment that evicted)."""
    return needs_segments(fields) and replay_status(fields) == "replayed"
