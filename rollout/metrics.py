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

`eviction_metrics(batch)` reduces them to scalars, e.g. for `metrics.update(eviction_metrics(batch))`
next to verl's `agent_loop/*` timing metrics.
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
    compressed = np.array([b is not None for b in nt["kvtier_budget"]])
    out = {f"{prefix}/compressed_fraction": float(compressed.mean()) if len(compressed) else 0.0}
    for key in COLUMNS:
        if key not in nt or not compressed.any():
            continue
        vals = np.array([float(v) for v, c in zip(nt[key], compressed) if c and v is not None])
        if len(vals):
            name = key.removeprefix("kvtier_")
            out[f"{prefix}/{name}/mean"] = float(vals.mean())
            out[f"{prefix}/{name}/max"] = float(vals.max())
    return out
