"""Per-sample eviction statistics in verl's rollout output, and their reduction for the trainer's logger.

The kvtier server puts its counters into `TokenOutput.extra_fields`, once per generate call; kvtier's
agent-loop workers add up the calls of each sample (every turn of a multi-turn agent loop, every attempt of a
resumed partial rollout: `kvtier.rollout.sample_counters`) and put the totals into the sample's output;
verl's agent loop (`AgentLoopWorker._postprocess`) turns every extra field into a column of the output
`DataProto.non_tensor_batch`, so after `generate_sequences` the batch carries:

| column | meaning |
| --- | --- |
| `kvtier_eviction_events` | eviction rounds applied to the sample (sum over its generate calls) |
| `kvtier_tokens_evicted` | tokens evicted per KV head (every head evicts the same count; sum) |
| `kvtier_peak_kv_blocks` | most KV blocks one generate call of the sample held at once (max) |
| `kvtier_preemptions` | times vLLM preempted (and recomputed) the sample (sum) |
| `kvtier_budget` | the budget K it ran with (None: full attention; counters are None too), first call |
| `kvtier_request_id` | vLLM's internal request id of the first call (the key of the audit log, if written) |
| `kvtier_protect_prefix` | the prompt prefix the server protected in the first call (None: the whole prompt) |
| `kvtier_seed`, `kvtier_buffer`, `kvtier_policy` | the first call's eviction seed (the server assigns one when the request has none), r and policy: for `random` the learner re-derives the sample's evictions from them (`kvtier.deathtime.simulate_deaths`) |
| `kvtier_generate_calls` | generate calls counted (turns, plus resumed attempts of partial rollouts) |

`eviction_metrics(batch)` reduces them to scalars (`rollout/kvtier/<column>/mean|max` over the compressed
samples, `rollout/kvtier/generate_calls/mean|max` over all, and `rollout/kvtier/compressed_fraction`). How they reach the trainer's logged metrics (see
`kvtier.rollout.trainer_hooks`): with `trainer.use_v1=false`, `KVTierAgentLoopManager` adds them to the
generated batch's `meta_info["timing"]`, which verl's `RayPPOTrainer` merges into the step's timing and
logs as `timing_s/rollout/kvtier/...` (as it does with its own `agent_loop/num_preempted/*`); with
`use_v1=true` the per-sample values travel inside each sample's `extra_fields` in the TransferQueue and the
`kvtier_<mode>` trainers reduce them with `eviction_metrics_from_fields` (logged as `rollout/kvtier/...`).

Without kvtier's agent-loop workers (verl's own `AgentLoopManager`) the counters describe the first generate
call of a multi-turn sample (verl's `ToolAgentLoop` keeps the first turn's `extra_fields`), and verl's
`FullyAsyncLLMServerClient` (its async v1 trainers) drops them from every sample (no kvtier metrics at all);
`kvtier_generate_calls` is missing then. See `kvtier.rollout.sample_counters` for why the sum is
taken in the agent-loop worker, not in verl's merges or the server.
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("kvtier_eviction_events", "kvtier_tokens_evicted", "kvtier_peak_kv_blocks", "kvtier_preemptions")
CALLS = "kvtier_generate_calls"


def per_sample_stats(batch) -> list[dict]:
    """One dict per sample: the kvtier columns plus the response length (from `response_mask`)."""
    nt = batch.non_tensor_batch
    n = len(batch)
    lengths = batch.batch["response_mask"].sum(-1).tolist() if "response_mask" in batch.batch.keys() else [None] * n
    rows = []
    for i in range(n):
        row = {"response_tokens": int(lengths[i]) if lengths[i] is not None else None}
        for key in ("kvtier_budget",) + COLUMNS:
            v = nt.get(key)
            row[key] = None if v is None or v[i] is None else int(v[i])
        rows.append(row)
    return rows


def eviction_metrics(batch, prefix: str = "rollout/kvtier") -> dict[str, float]:
    """mean/max of every kvtier column over the compressed samples (generate calls: over all samples), plus
    the compressed fraction."""
    nt = batch.non_tensor_batch
    if "kvtier_budget" not in nt:
        return {}
    n = len(nt["kvtier_budget"])
    rows = [{key: (nt[key][i] if key in nt else None) for key in ("kvtier_budget", CALLS) + COLUMNS} for i in range(n)]
    return eviction_metrics_from_fields(rows, prefix)


def eviction_metrics_from_fields(fields, prefix: str = "rollout/kvtier") -> dict[str, float]:
    """The same reduction over per-sample dicts (a sample's `extra_fields`, as verl's v1 trainer keeps them
    in the TransferQueue). Samples without `kvtier_budget` (not from a kvtier server) are left out; {} if
    none has it."""
    rows = [getattr(f, "data", f) for f in fields]
    rows = [r for r in rows if isinstance(r, dict) and "kvtier_budget" in r]
    if not rows:
        return {}
    compressed = [r for r in rows if r.get("kvtier_budget") is not None]
    out = {f"{prefix}/compressed_fraction": len(compressed) / len(rows)}
    for key in COLUMNS:
        vals = np.array([float(r[key]) for r in compressed if r.get(key) is not None])
        if len(vals):
            name = key.removeprefix("kvtier_")
            out[f"{prefix}/{name}/mean"] = float(vals.mean())
            out[f"{prefix}/{name}/max"] = float(vals.max())
    calls = np.array([float(r[CALLS]) for r in rows if r.get(CALLS) is not None])   # all samples, compressed or not
    if len(calls):
        out[f"{prefix}/generate_calls/mean"] = float(calls.mean())
        out[f"{prefix}/generate_calls/max"] = float(calls.max())
    return out
