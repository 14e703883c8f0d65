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
| `kvtier_policy_params` | the first call's policy keyword arguments as sorted JSON (protect_prefix included; None if none) |
| `kvtier_generate_calls` | generate calls counted (turns, plus resumed attempts of partial rollouts) |
| `kvtier_segments` | every call's segments, one per cache (JSON, `kvtier.deathtime.segments`): a rebuilt or multi-call sample is replayed by them |

`eviction_metrics(batch)` reduces them to scalars (`rollout/kvtier/<column>/mean|max` over the compressed
samples, `rollout/kvtier/generate_calls/mean|max` over all, `rollout/kvtier/compressed_fraction`, and
`rollout/kvtier/replayable/<status>`: how many samples came back with a record the learner can replay, and
why the others cannot, `kvtier.rollout.learner_replay.replay_status`; `rollout/kvtier/replayed_by_segment`: how
many of the replayable ones are replayed segment by segment; what the rollout returned, whatever the
learner then does: a replay learner logs its own forwards' shares as `actor/kvtier_replay/<status>_share`). `mismatch_metrics` compares the learner's old
log-probs with the rollout's per token (the v1 `kvtier_<mode>` trainers log it as `rollout/kvtier/mismatch/...`). How they reach the trainer's logged metrics (see
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

from .learner_replay import FIELDS as REPLAY_FIELDS
from .learner_replay import STATUSES, by_segment, replay_status

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
    keys = dict.fromkeys(("kvtier_budget", CALLS) + COLUMNS + REPLAY_FIELDS)
    rows = [{key: (nt[key][i] if key in nt else None) for key in keys} for i in range(n)]
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
    statuses = [replay_status(r) for r in rows]
    for status in STATUSES:
        out[f"{prefix}/replayable/{status}"] = float(statuses.count(status))
    out[f"{prefix}/replayed_by_segment"] = float(sum(by_segment(r) for r in rows))   # of replayable/replayed
    return out


def learner_entries(metrics: dict, prefix: str = "rollout/kvtier") -> tuple[dict, dict]:
    """The `mismatch/*` and `replayable/*` entries of a step's logged metrics, names without their prefix."""
    def under(part: str) -> dict:
        head = f"{prefix}/{part}/"
        return {k.removeprefix(head): v for k, v in metrics.items() if k.startswith(head)}

    return under("mismatch"), under("replayable")


# Sparrow (arXiv 2606.08446): training stays stable while the lower tail of per-token learner/sampler ratios
# stays above ~0.86, read as the 5th percentile (p05 >= 0.86); the mean hides it. `share_below_0_86` is the
# same criterion read the other way: p05 >= 0.86 when at most 5% of the tokens fall below 0.86 (at the
# boundary the quantile's interpolation decides).
TAIL_RATIO = 0.86
SEQ_K3_LOG_RATIO_BOUND = 20.0   # verl.trainer.ppo.rollout_corr_helper.SAFETY_BOUND
TAIL_QUANTILE = 0.05


def mismatch_metrics(old_log_probs, rollout_log_probs, response_mask,
                     prefix: str = "rollout/kvtier/mismatch") -> dict[str, float]:
    """Learner vs sampler over the response tokens ([B, T] tensors): per-token ratio = pi_learner / pi_rollout
    = exp(old_log_prob - rollout_log_prob). `kl`: the k3 estimate of KL(rollout || learner) per token (>= 0);
    `seq_k3_p50`, `seq_k3_p90`, `seq_k3_max`: over samples, each sample's mean k3 (verl's seq_mean_k3);
    `max_abs_log_ratio`; the ratio's `min`, 1st and 5th percentiles (`p05`: Sparrow's criterion, >= 0.86) and
    `share_below_0_86` (<= 0.05 when p05 >= 0.86, up to the quantile's interpolation)."""
    import torch

    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    full_log_ratio = (old_log_probs.float() - rollout_log_probs.float()).masked_fill(~mask, 0.0)
    log_ratio = full_log_ratio[mask]
    ratio = log_ratio.exp()
    # per sample: the mean k3 over its tokens, the statistic verl's rollout_rs=seq_mean_k3 thresholds (verl
    # clamps the log ratio to +-SAFETY_BOUND = 20 first; so does this)
    rows = mask.any(dim=-1)
    safe = full_log_ratio.clamp(-SEQ_K3_LOG_RATIO_BOUND, SEQ_K3_LOG_RATIO_BOUND)
    seq_k3 = ((safe.exp() - 1 - safe).sum(-1) / mask.sum(-1).clamp(min=1))[rows]
    return {f"{prefix}/kl": float((ratio - 1 - log_ratio).mean()),
            f"{prefix}/seq_k3_p50": float(torch.quantile(seq_k3, 0.5)),
            f"{prefix}/seq_k3_p90": float(torch.quantile(seq_k3, 0.9)),
            f"{prefix}/seq_k3_max": float(seq_k3.max()),
            f"{prefix}/max_abs_log_ratio": float(log_ratio.abs().max()),
            f"{prefix}/token_ratio_min": float(ratio.min()),
            f"{prefix}/token_ratio_p01": float(torch.quantile(ratio, 0.01)),
            f"{prefix}/token_ratio_p05": float(torch.quantile(ratio, TAIL_QUANTILE)),
            f"{prefix}/share_below_0_86": float((ratio < TAIL_RATIO).float().mean())}


def group_signal_metrics(uids, scores, prefix: str = "rollout/kvtier") -> dict[str, float]:
    """GRPO learns only from groups whose rewards differ: `<prefix>/grpo/groups` (prompts in the step) and
    `<prefix>/grpo/groups_with_signal` (those whose samples' scores are not all equal)."""
    groups: dict = {}
    for uid, score in zip(uids, scores):
        groups.setdefault(uid, []).append(float(score))
    signal = sum(1 for s in groups.values() if max(s) - min(s) > 1e-6)
    return {f"{prefix}/grpo/groups": float(len(groups)), f"{prefix}/grpo/groups_with_signal": float(signal)}
