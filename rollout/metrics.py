"""Per-sample eviction statistics in verl's rollout output, and their reduction for the trainer's logger.

The kvtier server puts one value per sample into `TokenOutput.extra_fields`; verl's agent loop
(`AgentLoopWorker._postprocess`) turns every extra field into a column of the output
`DataProto.non_tensor_batch`, so after `generate_sequences` the batch carries:

| column | meaning |
| --- | --- |
| `kvtier_eviction_events` | eviction rounds applied to the sample |
| `kvtier_tokens_evicted` | tokens evicted per KV head (every head evicts the same count) |
| `kvtier_peak_kv_blocks` | most KV blocks the sample held at once |
| `kvtier_preemptions` | times vLLM preempted (and recomputed) the sample |
| `kvtier_budget` | the budget K it ran with (None: full attention; counters are None too) |
| `kvtier_request_id` | vLLM's internal request id (the key of the audit log, if one is written) |

`eviction_metrics(batch)` reduces them to scalars (`rollout/kvtier/<column>/mean|max` and
`rollout/kvtier/compressed_fraction`). How they reach the trainer's logged metrics (see
`kvtier.rollout.trainer_hooks`): with `trainer.use_v1=false`, `KVTierAgentLoopManager` adds them to the
generated batch's `meta_info["timing"]`, which verl's `RayPPOTrainer` merges into the step's timing and
logs as `timing_s/rollout/kvtier/...` (as it does with its own `agent_loop/num_preempted/*`); with
`use_v1=true` the per-sample values travel inside each sample's `extra_fields` in the TransferQueue and the
`kvtier_<mode>` trainers reduce them with `eviction_metrics_from_fields` (logged as `rollout/kvtier/...`).

Multi-turn agent loops keep the first turn's `extra_fields` only (verl's `ToolAgentLoop`), and verl's
`FullyAsyncLLMServerClient` rebuilds the output of a resumed partial rollout without them: for those
samples the counters describe the first generate call (or are missing, and count as not compressed).
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("kvtier_eviction_events", "kvtier_tokens_evicted", "kvtier_peak_kv_blocks", "kvtier_preemptions")


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
    """mean/max of every kvtier column over the compressed samples, plus the compressed fraction."""
    nt = batch.non_tensor_batch
    if "kvtier_budget" not in nt:
        return {}
    n = len(nt["kvtier_budget"])
    rows = [{key: (nt[key][i] if key in nt else None) for key in ("kvtier_budget",) + COLUMNS} for i in range(n)]
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
    return out
