"""Which path the RL learner takes for one sample, read off the per-sample fields the rollout returned.

`replay_status(fields)` is one of STATUSES: `replayed` (a record the learner re-derives and replays), `full`
(full attention), `rebuilt` (preempted and recomputed mid-generation), `multi_call` (several generate calls),
`policy` (a policy that reads the cache), `no_record` (not kvtier's agent-loop manager). The rollout's
metrics (`rollout.metrics`) and the learner's shares (`learner_replay`) both count by it. `rebuilt` and
`multi_call` samples are scored dense: their segments' deaths are derivable exactly
(`kvtier.deathtime.segments`, tested equal to the engine's audit log), but the rollout does not yet return
each segment's record, and a segment after one that evicted needs a forward of its own (`docs/rl.md`).
"""

from __future__ import annotations

from typing import Any, Mapping

REPLAYABLE_POLICIES = ("random",)       # policies whose records are re-derived (and tested equal to the engine's)
STATUSES = ("replayed", "full", "rebuilt", "multi_call", "policy", "no_record")
FIELDS = ("kvtier_budget", "kvtier_seed", "kvtier_buffer", "kvtier_policy", "kvtier_policy_params",
          "kvtier_preemptions", "kvtier_generate_calls")


def replay_status(fields: Mapping[str, Any]) -> str:
    """How the learner scores one sample, from its per-sample fields (one of STATUSES)."""
    if fields.get("kvtier_budget") is None:
        return "full"
    if fields.get("kvtier_seed") is None or fields.get("kvtier_generate_calls") is None:
        return "no_record"
    if int(fields.get("kvtier_preemptions") or 0) > 0:
        return "rebuilt"
    if int(fields["kvtier_generate_calls"]) > 1:
        return "multi_call"
    if fields.get("kvtier_policy") not in REPLAYABLE_POLICIES:
        return "policy"
    return "replayed"
