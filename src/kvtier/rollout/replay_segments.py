"""Replay by segment: a sample generated on several caches is scored with one forward row per segment that
evicted, and each token's log-prob is taken from the row of the segment that sampled it.

A sample preempted and recomputed, or made by several generate calls (tool turns, resumed partial rollouts),
was sampled on one cache per segment (`kvtier.deathtime.segments`): a segment's cache was built by a prefill
over every position before it, under full causal attention, and then thinned by its own rounds. One forward
computes each position's keys once, so a segment after one that evicted needs its own forward over its prefix
[0, end] under its own deaths, as the masked reference runs it (`kvtier.reference.replay`). Here:

* `sample_rows`: the forward rows of one sample. A sample with one cache (or whose earlier segments ran no
  round: `one_tensor_deaths`'s case) is one row, as before; otherwise one row per `forward_segments` entry,
  each fed the sample's tokens [0, end + 1) (the last: all of them).
* `expand_micro_batch`: verl's micro-batch with those rows in place of its samples (input_ids, position_ids,
  per-sample temperature, and its batch-wide settings), the batch verl's own `prepare_model_inputs` /
  `prepare_model_outputs` then see: padded and packed (`use_remove_padding`) alike.
* `gather_outputs`: each per-token output (log-probs, entropy, ...) back into the sample's row: token row i of
  a sample comes from its first forward row whose segment ends after i, else from its last; an index into the
  outputs, so gradients flow into every row that contributed.

Rows before a segment's start see full causal attention in that segment's forward (no key dies before the
start), which is what the prompt, a segment that ran no round, and the tokens between calls (tool replies,
masked out of the loss) need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.deathtime.segments import Segment, forward_segments


@dataclass(frozen=True)
class Row:
    """One forward row: the micro-batch sample it scores, the tokens it is fed ([0, length) of the sample),
    and the segment whose deaths it runs under (None: the sample's own record, or the dense path)."""

    sample: int
    length: int
    segment: Segment | None = None


def clipped(segments: list[Segment], length: int) -> list[Segment]:
    """The segments' rows inside a sample of `length` tokens (verl cuts a response at response_length)."""
    out = []
    for s in segments:
        if s.start - 1 >= length:
            break
        out.append(s if s.end <= length else Segment(**{**s.__dict__, "end": length}))
    return out


def sample_rows(sample: int, length: int, segments: list[Segment] | None) -> list[Row]:
    """The forward rows of one sample; `segments`: its record when it is replayed by segment, else None."""
    segments = clipped(segments, length) if segments else []
    if not segments:
        return [Row(sample, length)]
    fwd = forward_segments(segments)
    return [Row(sample, min(s.end + 1, length), s) for s in fwd[:-1]] + [Row(sample, length, fwd[-1])]


def expands(rows: list[Row]) -> bool:
    """Some sample has more than one forward row."""
    return len({r.sample for r in rows}) < len(rows)


def take_index(rows: list[Row], lengths: list[int]) -> torch.Tensor:
    """For every token row of the micro-batch's samples (their concatenation), its index into the
    concatenated forward rows: the first row of its sample whose segment ends after it, else the last."""
    starts, offset = {}, 0
    for r in rows:
        starts.setdefault(r.sample, []).append((offset, r))
        offset += r.length
    parts = []
    for b, n in enumerate(lengths):
        mine = starts[b]
        ends = torch.tensor([r.segment.end for _, r in mine[:-1]], dtype=torch.long)
        i = torch.arange(n)
        j = torch.searchsorted(ends, i, right=True)                  # rows whose segment ends at or before i
        parts.append(torch.tensor([o for o, _ in mine], dtype=torch.long)[j] + i)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class ExpansionError(ValueError):
    """A micro-batch the segment expansion has not been built for; the message says what."""


def _carries(value) -> bool:
    """Whether a micro-batch field holds anything: verl puts `multi_modal_inputs` (one empty dict per sample) into
    text-only batches too, and `distillation_use_topk` is a False flag when distillation is off."""
    if value is None or value is False:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, dict):
        return bool(value)
    if isinstance(value, (list, tuple)):
        return any(_carries(v) for v in value)
    if hasattr(value, "tolist"):                     # tensordict's NonTensorStack
        return _carries(value.tolist())
    if hasattr(value, "data"):                       # NonTensorData
        return _carries(value.data)
    return True


def expand_micro_batch(micro_batch, rows: list[Row]):
    """verl's micro-batch (a TensorDict of jagged tensors) with `rows` in place of its samples: what verl's
    `prepare_model_inputs` and `prepare_model_outputs` read (input_ids, position_ids, temperature, and every
    batch-wide NonTensorData setting)."""
    from tensordict import NonTensorData, TensorDict

    for key in ("multi_modal_inputs", "teacher_logprobs", "teacher_ids", "distillation_use_topk"):
        if _carries(micro_batch.get(key, None)):
            raise ExpansionError(f"kvtier learner replay by segment: micro-batches with {key} are not supported")
    index = torch.tensor([r.sample for r in rows], dtype=torch.long)

    def cut(name: str):
        parts = micro_batch[name].unbind()
        if parts[0].dim() != 1:
            raise ExpansionError(f"kvtier learner replay by segment: {name} of shape {tuple(parts[0].shape)} "
                                 "per sample (multi-dimensional positions) is not supported")
        return torch.nested.nested_tensor([parts[r.sample][: r.length] for r in rows], layout=torch.jagged)

    out = TensorDict({"input_ids": cut("input_ids"), "position_ids": cut("position_ids")}, batch_size=[len(rows)],
                     device=micro_batch.device)
    for key in micro_batch.keys():
        value = micro_batch.get(key)
        if isinstance(value, NonTensorData):
            out[key] = NonTensorData(value.data)
    temperature = micro_batch.get("temperature", None)
    if isinstance(temperature, torch.Tensor):
        out["temperature"] = temperature[index.to(temperature.device)]
    return out


def gather_outputs(model_output: dict, rows: list[Row], lengths: list[int], offsets: torch.Tensor) -> dict:
    """`prepare_model_outputs`' per-token outputs of the expanded batch (jagged, one entry per row) as the
    micro-batch's (jagged by `offsets`, its input_ids' offsets); other entries as they are."""
    take = None
    out = {}
    for key, value in model_output.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            if take is None:
                take = take_index(rows, lengths).to(value.device)
            value = torch.nested.nested_tensor_from_jagged(value.values()[take], offsets.to(value.device))
        out[key] = value
    return out
