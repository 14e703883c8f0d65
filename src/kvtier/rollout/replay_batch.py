"""The death tensor of one learner forward, assembled from each sample's record (the learner replay's host work).

Each replayed sample's [layers, kv_heads, length] deaths are re-derived from its record (`sample_deaths`:
`kvtier.deathtime.simulate_deaths`, equal to the engine's audit log) once per step and kept compactly in a
bounded store (`replay_store`); a forward's micro-batch tensor is filled from the store one sample at a time
(`micro_batch_deaths`), on the learner's device. A sample replayed by segment (`replay_segments`) has a row per
segment that evicted, each derived and stored on its own (`stored_segment_deaths`). `derive_encoded` and
`derive_segment_encoded` are the units of work the background workers (`replay_prefetch`) run: picklable
functions of a sample's fields (or a segment) and shape.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from .replay_segments import Row, sample_rows
from .replay_status import FIELDS, STATUSES, by_segment, replay_status, segment_record


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
    """A replayed sample's deaths in the store's compact form (`deathtime.store.encode`), derived in that form
    (`simulate_encoded`: no dense [layers, kv_heads, length] tensor is built)."""
    from kvtier.deathtime.simulate import simulate_encoded

    policy, schedule = _policy_schedule(fields)
    return simulate_encoded(policy, schedule, int(prompt_len), int(length), num_layers=int(num_layers),
                            num_kv_heads=int(num_kv_heads), seed=int(fields["kvtier_seed"]))


def segment_key(segment, num_layers: int, num_kv_heads: int) -> tuple:
    """What identifies a segment's derivation in the store."""
    return ("segment", segment, int(num_layers), int(num_kv_heads))


def derive_segment_encoded(segment, num_layers: int, num_kv_heads: int):
    """A segment's deaths over its rows' keys [0, end) in the store's compact form, derived in that form."""
    from kvtier.deathtime.simulate import simulate_encoded

    policy, schedule = segment.policy_schedule()
    return simulate_encoded(policy, schedule, segment.prompt_len, segment.end, num_layers=int(num_layers),
                            num_kv_heads=int(num_kv_heads), seed=segment.seed, start=segment.start,
                            rounds_before=segment.rounds_before)


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


def stored_segment_deaths(segment, num_layers: int, num_kv_heads: int, store=None):
    """`stored_sample_deaths` for one segment of a sample replayed by segment: its keys [0, segment.end)."""
    store = replay_store() if store is None else store
    return store.serve(segment_key(segment, num_layers, num_kv_heads),
                       lambda: derive_segment_encoded(segment, num_layers, num_kv_heads))


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


def replay_rows(micro_batch, fields: list[dict] | None = None) -> list[Row]:
    """The forward rows of a micro-batch, in sample order (`replay_segments.sample_rows`): one per sample,
    or one per segment that evicted for a sample replayed by segment."""
    fields = batch_fields(micro_batch) if fields is None else fields
    lengths = sample_lengths(micro_batch)
    return [row for b, (f, n) in enumerate(zip(fields, lengths))
            for row in sample_rows(b, n, segment_record(f) if by_segment(f) else None)]


def replayed_samples(batch, num_layers: int, num_kv_heads: int) -> list[tuple[tuple, tuple]]:
    """(store key, work: a derivation function and its arguments) of every replayed row of a verl batch, in
    batch order (`replay_prefetch` runs the work)."""
    fields = batch_fields(batch)
    if not any(replay_status(f) == "replayed" for f in fields):
        return []
    shape = (int(num_layers), int(num_kv_heads))
    out = []
    prompts = prompt_lengths(batch)
    for row in replay_rows(batch, fields):
        f = fields[row.sample]
        if replay_status(f) != "replayed":
            continue
        if row.segment is not None:
            out.append((segment_key(row.segment, *shape), (derive_segment_encoded, row.segment, *shape)))
        else:
            args = (f, int(prompts[row.sample]), int(row.length), *shape)
            out.append((sample_key(*args), (derive_encoded, *args)))
    return out


def micro_batch_deaths(micro_batch, width: int, *, packed: bool, num_layers: int, num_kv_heads: int,
                       device: torch.device | str = "cpu", store=None,
                       rows: list[Row] | None = None) -> tuple[Tensor | None, dict[str, int]]:
    """The death tensor for one forward of verl's engine, on `device`, and how many samples took each path.

    rows: the forward's rows (`replay_rows(micro_batch)`, the default: one per sample unless a sample is
    replayed by segment). padded (use_remove_padding=false): [rows, layers, kv_heads, width], row r in columns
    0..len_r-1; packed (true): [1, layers, kv_heads, width], row r at its offset in the packed sequence and
    every key dead at its row's end. None when no sample is replayed (the layer runs plain SDPA). Rows are
    derived one at a time on the host (or read from `store`, default `replay_store()`: once per step) and
    copied in: the host holds one row's dense tensor at a time, beside the store's compact ones."""
    from kvtier.deathtime import NEVER

    fields = batch_fields(micro_batch)
    statuses = [replay_status(f) for f in fields]
    counts = {s: statuses.count(s) for s in STATUSES}
    if "replayed" not in statuses:
        return None, counts
    rows = replay_rows(micro_batch, fields) if rows is None else rows
    prompts = prompt_lengths(micro_batch)
    out = torch.full((1 if packed else len(rows), num_layers, num_kv_heads, width), NEVER, dtype=torch.int32,
                     device=device)
    offset = 0
    for r, row in enumerate(rows):
        start = offset if packed else 0
        end = start + row.length
        offset += row.length
        dst = out[0 if packed else r, :, :, start:end]
        if statuses[row.sample] != "replayed":
            if packed:
                dst.fill_(end)                          # full attention inside its own segment only
            continue
        if row.segment is None:
            index, table = stored_sample_deaths(fields[row.sample], prompts[row.sample], row.length, num_layers,
                                                num_kv_heads, store)
            covered = row.length
        else:                                           # keys from the segment's end on never die in its rows
            index, table = stored_segment_deaths(row.segment, num_layers, num_kv_heads, store)
            covered = row.segment.end
            if packed:
                dst[..., covered:].fill_(end)
        table = np.where(table == NEVER, table, table + start)      # shifted to its columns: 231 values, not 9.4M
        dst[..., :covered].copy_(expand(index, np.minimum(table, end) if packed else table, out.device))
    return out, counts


def expand(index: np.ndarray, table: np.ndarray, device: torch.device, on_device: bool | None = None) -> Tensor:
    """`table[index]`: a row's int32 deaths from the store's compact pair. On an accelerator (`on_device`, the
    default off the CPU) the round index crosses the bus (1-2 bytes a key, not 4) and the device gathers, so the
    host only hands over the stored arrays; on the CPU numpy gathers (several times torch's CPU indexing)."""
    if not (device.type != "cpu" if on_device is None else on_device):
        return torch.from_numpy(table[index])
    return torch.from_numpy(table).to(device)[torch.from_numpy(index).to(device).to(torch.int32)]
