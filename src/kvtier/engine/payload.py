"""What the scheduler sends the worker each step (one attribute on vLLM's SchedulerOutput).

Plain dataclasses: they cross the process boundary with the SchedulerOutput (pickled by the
multiprocess executor; extra attributes survive).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EvictionSpec

PAYLOAD_ATTR = "kvtier"


@dataclass
class CompactionOp:
    req_id: str
    old_len: int          # physical entries per head before the round
    new_len: int          # after (K + r)
    keep_blocks: int      # the request keeps its first keep_blocks blocks
    prompt_len: int
    spec: EvictionSpec
    round: int
    query_position: int   # logical position of the newest cached token


@dataclass
class StepPayload:
    ops: list[CompactionOp] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)   # logical - physical, per scheduled request
    resets: dict[str, int] = field(default_factory=dict)    # preempted: req -> first query row recomputed in full
    blocks_freed: int = 0
    preempted_compressed: int = 0
    tightenings: dict[str, int] = field(default_factory=dict)   # elastic requests tightened, by why
    elastic: tuple[int, int] = (0, 0)     # elastic requests (at their floor, in all) held by the scheduler

# What the worker sends back on the step's ModelRunnerOutput: {req_id: error} for requests whose policy
# failed (the scheduler finishes them with an error).
FAILURES_ATTR = "kvtier_failures"
