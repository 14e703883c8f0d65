"""Eviction counters (worker process) and the optional keep-set audit log."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

ROUND_MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000)
# Distinct budget labels counted per policy before the rest are counted as "other": a request may carry any
# budget (vllm_xargs), and every label is a time series in Prometheus.
MAX_BUDGET_LABELS = 16


def budget_label(budget: int, floor: int | None = None) -> str:
    """The `budget` label of an eviction round: "512" for a fixed K = 512, "elastic:512" for an elastic
    request tightened to its floor 512 (what tells apart tiers that share an engine and a policy)."""
    return f"elastic:{floor}" if floor is not None else str(budget)


@dataclass
class RequestCounters:
    events: int = 0            # eviction rounds applied to this request
    tokens_evicted: int = 0    # per KV head (each head evicts the same count, different tokens)
    peak_blocks: int = 0
    preemptions: int = 0
    # one [reset_row, rounds_before] per recompute: the row the resumed prefill sampled from and the rounds
    # applied before it (what the learner needs to replay the request by segment: kvtier.deathtime.segments)
    resets: list = field(default_factory=list)


@dataclass
class EngineCounters:
    events: int = 0                  # request-rounds applied
    steps_with_eviction: int = 0     # engine steps that ran >= 1 round (all due rounds run together)
    tokens_evicted: int = 0
    blocks_freed: int = 0
    preemptions_compressed: int = 0
    policy_failures: int = 0         # rounds whose policy raised (the request was aborted with an error)
    wakeups: int = 0                 # wake-ups after vLLM sleep mode (device tables rebuilt each time)
    # elastic budgets (engine/elastic.py): tightenings by why ("preemption": this step's running requests
    # would not have fit, each one a preemption avoided; "admission": the next waiting request would not),
    # tokens their rounds evicted (per KV head), and elastic requests held now (at their floor, in all)
    tightenings: dict[str, int] = field(default_factory=dict)
    tokens_evicted_under_pressure: int = 0
    elastic_at_floor: int = 0
    elastic_requests: int = 0
    round_ms_sum: float = 0.0
    round_ms_count: int = 0
    round_ms_buckets: list[int] = field(default_factory=lambda: [0] * (len(ROUND_MS_BUCKETS) + 1))
    # policy -> {events, tokens_evicted, by_budget: {budget_label -> {events, tokens_evicted}}}
    by_policy: dict[str, dict] = field(default_factory=dict)


class EvictionStats:
    """Engine totals plus per-request counters.

    A request's counters live while it runs, however many requests there are: only finished requests
    (`finish`, called with the scheduler's finished_req_ids) are ever dropped, the oldest first, once more
    than `keep_finished` of them are kept AND the oldest finished more than `keep_finished_s` seconds ago
    (so a reader that asks right after a request finishes still finds it); `max_finished` bounds memory
    whatever the age."""

    def __init__(self, keep_finished: int = 4096, keep_finished_s: float = 300.0, max_finished: int = 65536,
                 clock=time.monotonic) -> None:
        self.engine = EngineCounters()
        self.requests: dict[str, RequestCounters] = {}
        self.keep_finished = keep_finished
        self.keep_finished_s = keep_finished_s
        self.max_finished = max(max_finished, keep_finished)
        self._finished: "OrderedDict[str, float]" = OrderedDict()   # finished request -> when
        self._clock = clock
        self._lock = threading.Lock()
        self._round_ms_samples: deque[float] = deque(maxlen=10000)  # drained by metric exporters

    def record_round(self, req_id: str, policy: str, tokens_evicted: int, budget: str = "other") -> None:
        """One request-round applied; `budget`: its `budget_label`."""
        rc = self.request(req_id)
        rc.events += 1
        rc.tokens_evicted += tokens_evicted
        e = self.engine
        e.events += 1
        e.tokens_evicted += tokens_evicted
        p = e.by_policy.setdefault(policy, {"events": 0, "tokens_evicted": 0, "by_budget": {}})
        p["events"] += 1
        p["tokens_evicted"] += tokens_evicted
        if budget not in p["by_budget"] and len(p["by_budget"]) >= MAX_BUDGET_LABELS:
            budget = "other"
        b = p["by_budget"].setdefault(budget, {"events": 0, "tokens_evicted": 0})
        b["events"] += 1
        b["tokens_evicted"] += tokens_evicted

    def drain_round_ms(self) -> list[float]:
        """Round times observed since the last drain (for histogram exporters)."""
        with self._lock:
            out = list(self._round_ms_samples)
            self._round_ms_samples.clear()
        return out

    def request(self, req_id: str) -> RequestCounters:
        rc = self.requests.get(req_id)
        if rc is None:
            with self._lock:
                rc = self.requests[req_id] = RequestCounters()
        return rc

    def finish(self, req_ids) -> None:
        """These requests finished (or were aborted): their counters may be dropped later, oldest first."""
        now = self._clock()
        with self._lock:
            for rid in req_ids:
                if rid in self.requests:
                    self._finished[rid] = now
                    self._finished.move_to_end(rid)
            while self._finished:
                rid, when = next(iter(self._finished.items()))
                over = len(self._finished) > self.keep_finished
                if not (len(self._finished) > self.max_finished or (over and now - when > self.keep_finished_s)):
                    break
                self._finished.popitem(last=False)
                self.requests.pop(rid, None)

    @property
    def running(self) -> int:
        """Requests with counters that have not finished."""
        return len(self.requests) - len(self._finished)

    def observe_round_ms(self, ms: float) -> None:
        self._round_ms_samples.append(ms)
        e = self.engine
        e.round_ms_sum += ms
        e.round_ms_count += 1
        i = next((i for i, b in enumerate(ROUND_MS_BUCKETS) if ms <= b), len(ROUND_MS_BUCKETS))
        e.round_ms_buckets[i] += 1

    def snapshot(self, request_ids: list[str] | None = None) -> dict:
        with self._lock:
            reqs = self.requests if request_ids is None else {r: self.requests[r] for r in request_ids if r in self.requests}
            return {
                "engine": asdict(self.engine),
                "round_ms_bucket_bounds": list(ROUND_MS_BUCKETS),
                "requests": {k: asdict(v) for k, v in reqs.items()},
            }


class AuditLog:
    """One JSON line per request-round: the kept logical positions of every (layer, KV head)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_audit_log(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
