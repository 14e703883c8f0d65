"""The death tensor of one learner forward, assembled from each sample's record (the learner replay's host work).

Each replayed sample's [layers, kv_heads, length] deaths are re-derived from its record (`sample_deaths`:
`kvtier.deathtime.simulate_deaths`, equal to the engine's audit log) once per step and kept compactly in a
bounded store (`replay_store`); a forward's micro-batch tensor is filled from the store one sample at a time
(`micro_batch_deaths`), on the learner's device. `derive_encoded` is the unit of work the background workers
(`replay_prefetch`) run: a picklable function of the sample's fields and shape.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from .replay_status import FIELDS, STATUSES, replay_status


def _policy_schedule(fields: Mapping[str, Any]):
    from kvtier.policies import EvictionSchedule, make_policy

    policy = make_policy(str(fields["kvtier_policy"]), **json.loads(fields.get("kvtier_policy_params") or "{}"))
    return policy, EvictionSchedule(int(fields["kvtier_budget"]), int(fields["kvtier_buffer"]))


def sample_deaths(fields: Mapping[str, Any], prompt_len: int, length: int, num_layers: int,
                  num_kv_heads: int) -> Tensor | None:
    """[layers, kv_heads, length] int32 death times of a replayed sample; None for the dense path."""
    if replay_status(fields) != "replayed":
        return None
    from kvtier.deathtime import simulate_deaths

    policy, schedule = _policy_schedule(fields)
    return simulate_deaths(policy, schedule, int(prompt_len), int(length), num_layers=int(num_layers),
                           num_kv_heads=int(num_kv_heads), seed=int(fields["kvtier_seed"]))


def sample_key(fields: Mapping[str, Any], prompt_len: int, length: int, num_layers: int, num_kv_heads: int) -> tuple:
    """What identifies a sample's derivation in the store: its record and shape."""
    return tuple(fields.get(k) for k in FIELDS[:5]) + (int(prompt_len), int(length), int(num_layers), int(num_kv_heads))


def derive_encoded(fields: Mapping[str, Any], prompt_len: int, length: int, num_layers: int, num_kv_heads: int):
    """A replayed sample's deaths in the store's compact form (`deathtime.store.encode`)."""
    from kvtier.deathtime import round_positions
    from kvtier.deathtime.store import encode

    _, schedule = _policy_schedule(fields)
    times = [qp + 1 for qp in round_positions(schedule, int(prompt_len), int(length))]
    return encode(sample_deaths(fields, prompt_len, length, num_layers, num_kv_heads), times)


# One step's forwards (reference, old log-probs, each PPO epoch) share each sample's derivation through this
# store: compact (a uint8 round index per entry: 9.4 MB per 32k sample at Qwen3-4B shapes), admitted while it
# fits, dropped when the next step starts (`kvtier.deathtime.store`). KVTIER_REPLAY_STORE_BYTES=0 turns it off.
STORE_BYTES = int(os.environ.get("KVTIER_REPLAY_STORE_BYTES", 640 << 20))
_STORE: list = []


def replay_store():
    """This process's `DeathStore` (made on first use)."""
    if not _STORE:
        from kvtier.deathtime.store import DeathStore

        _STORE.append(DeathStore(STORE_BYTES))
    return _STORE[0]


def stored_sample_deaths(fields: Mapping[str, Any], prompt_len: int, length: int, num_layers: int,
                         num_kv_heads: int, store=None):
    """`sample_deaths` of a replayed sample through `store` (default: `replay_store()`; or anything with its
    `serve`, such as a `replay_prefetch.Prefetcher`), derived once per step, in the store's compact form:
    (round index per entry, death time per round index; `deathtime.store`)."""
    store = replay_store() if store is None else store
    key = sample_key(fields, prompt_len, length, num_layers, num_kv_heads)
    return store.serve(key, lambda: derive_encoded(fields, prompt_len, length, num_layers, num_kv_heads))


def batch_fields(micro_batch) -> list[dict[str, Any]]:
    """Each sample's kvtier fields from a verl micro-batch: the v1 trainer's `extra_fields` column (one dict per
    sample) or the v0 trainer's one column per key (DataProto's non-tensor batch)."""
    keys = set(micro_batch.keys())
    n = micro_batch.batch_size[0]
    if "extra_fields" in keys:
        col = _as_list(micro_batch["extra_fields"])
        return [{k: (row or {}).get(k) for k in FIELDS} for row in col]
    cols = {k: _as_list(micro_batch[k]) for k in FIELDS if k in keys}
    return [{k: cols[k][b] if k in cols else None for k in FIELDS} for b in range(n)]


def _as_list(value) -> list:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value)


def prompt_lengths(micro_batch) -> list[int]:
    """Each sample's prompt length: the v1 trainer keeps `prompts` as a nested (jagged) tensor; the v0
    trainer's batch has the left-padded prompt's ones in `attention_mask` before the response columns."""
    keys = set(micro_batch.keys())
    if "prompts" in keys and micro_batch["prompts"].is_nested:
        return micro_batch["prompts"].offsets().diff().tolist()
    if "attention_mask" in keys and "response_mask" in keys and not micro_batch["attention_mask"].is_nested:
        attn, resp = micro_batch["attention_mask"], micro_batch["response_mask"]
        responses = int(micro_batch.get_non_tensor("max_response_len")) if resp.is_nested else resp.shape[-1]
        return [int(x) for x in attn[:, : attn.shape[-1] - responses].sum(-1).tolist()]
    raise ValueError(f"kvtier learner replay: no prompt lengths in the micro-batch (keys: {sorted(keys)})")


def sample_lengths(batch) -> list[int]:
    """Each sample's token count (prompt + response) from the jagged `input_ids`."""
    return batch["input_ids"].offsets().diff().tolist()


def replayed_samples(batch, num_layers: int, num_kv_heads: int) -> list[tuple[tuple, tuple]]:
    """(store key, `derive_encoded` arguments) of every replayed sample of a verl batch, in batch order."""
    fields = batch_fields(batch)
    if not any(replay_status(f) == "replayed" for f in fields):
        return []
    out = []
    for f, p, n in zip(fields, prompt_lengths(batch), sample_lengths(batch)):
        if replay_status(f) == "replayed":
            args = (f, int(p), int(n), int(num_layers), int(num_kv_heads))
            out.append((sample_key(*args), args))
    return out


def micro_batch_deaths(micro_batch, width: int, *, packed: bool, num_layers: int, num_kv_heads: int,
                       device: torch.device | str = "cpu", store=None) -> tuple[Tensor | None, dict[str, int]]:
    """The death tensor for one forward of verl's engine, on `device`, and how many samples took each path.

    padded (use_remove_padding=false): [B, layers, kv_heads, width], sample b in columns 0..len_b-1;
    packed (true): [1, layers, kv_heads, width], sample b at its cu_seqlens offset and every key dead at its
    segment's end. None when no sample is replayed (the layer runs plain SDPA). Samples are derived one at a
    time on the host (or read from `store`, default `replay_store()`: once per step) and copied in: the host
    holds one sample's dense tensor at a time, beside the store's compact ones."""
    from kvtier.deathtime import NEVER

    fields = batch_fields(micro_batch)
    offsets = micro_batch["input_ids"].offsets().tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    statuses = [replay_status(f) for f in fields]
    counts = {s: statuses.count(s) for s in STATUSES}
    if "replayed" not in statuses:
        return None, counts
    prompts = prompt_lengths(micro_batch)
    out = torch.full((1 if packed else len(fields), num_layers, num_kv_heads, width), NEVER, dtype=torch.int32,
                     device=device)
    for b, (f, status) in enumerate(zip(fields, statuses)):
        start = offsets[b] if packed else 0
        end = start + lengths[b]
        row = out[0 if packed else b, :, :, start:end]
        if status != "replayed":
            if packed:
                row.fill_(end)                          # full attention inside its own segment only
            continue
        index, table = stored_sample_deaths(f, prompts[b], lengths[b], num_layers, num_kv_heads, store)
        table = np.where(table == NEVER, table, table + start)      # shifted to its columns: 231 values, not 9.4M
        row.copy_(torch.from_numpy((np.minimum(table, end) if packed else table)[index]))
    return out, counts
