"""One group's forward and backward in a reasoner training step (reasoner_train.py's loop).

The loss is sum(w * token cross-entropy) / total over the step's groups, so it splits over rows: on a CPU a
group of long rows runs one row at a time, each cut to its own length, instead of one right-padded batch,
whose attention is paid up to the longest row for every row (quadratic in it). chains-long, long-8kv, bf16, 2
cores, 2026-12-05: the forward and backward of 8 rows of 2.6-3.6k tokens 7.0-8.0 s padded, 5.8-6.3 s a row at a
time; a whole p1 step (with its data and optimizer) 8.2-8.7 s before, 6.8-6.9 s after. The gradient is the
same sum (in another order: the last bits differ). On a GPU the batch stays whole (it pays no padding time
worth 8 launches), and so does a group narrower than SPLIT_FROM (the `chains` family, short chains), so the
shipped reasoner's phases compute what they computed.
"""

from __future__ import annotations

import torch

from .train_eviction import row_spans

SPLIT_FROM = 2048    # tokens: a group at least this wide runs a row at a time on a CPU


def splits_rows(device: str, width: int) -> bool:
    return torch.device(device).type == "cpu" and width >= SPLIT_FROM


def rows(ids, labels, w, extra: dict, plan) -> list[tuple]:
    """(ids, labels, w, extra) of each row cut to its length (its last labelled token); a row under full
    attention (plan (None, _)) drops the death times, whose all-NEVER mask would only slow its attention."""
    out = []
    for i, n in enumerate(row_spans(labels)[1]):
        x = {} if plan[i][0] is None else {k: v[i:i + 1, ..., :n] for k, v in extra.items()}
        out.append((ids[i:i + 1, :n], labels[i:i + 1, :n], w[i:i + 1, :n - 1], x))
    return out


def backward_group(model, ids, labels, w, extra: dict, plan, total: float, *, bf16: bool, hf_loss: bool,
                   split: bool) -> float:
    """Accumulate the gradient of the group's share of the step's loss, sum(w * cross-entropy) / total; its
    value. `hf_loss`: transformers' own mean loss scaled by the group's token count (how the shipped reasoner's
    first phases ran: their weights are 1 on every trace token); `split`: a row at a time (`rows`)."""
    pieces = rows(ids, labels, w, extra, plan) if split else [(ids, labels, w, extra)]
    value = 0.0
    for ids, labels, w, extra in pieces:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            if hf_loss:
                loss = model(input_ids=ids, labels=labels).loss * (float(w.sum()) / total)
            else:
                logits = model(input_ids=ids, **extra).logits[:, :-1].float()
                ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:].clamp(min=0),
                                                       reduction="none")
                loss = (ce * w).sum() / total
        loss.backward()
        value += loss.item()
    return value
