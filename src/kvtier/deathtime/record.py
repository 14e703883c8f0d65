"""Death-time records: building them from round records, placing them in a padded batch, visibility.

deaths [layers, kv_heads, N] (int32): deaths[l, h, j] is the first query position that no longer saw
entry j (`NEVER`: it survived). Visible: j <= i < deaths[l, h, j].
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

NEVER = torch.iinfo(torch.int32).max


class RebuiltCacheError(ValueError):
    """The records describe a cache rebuilt after a round (a preemption's recompute, a reset): entries
    that died came back, so one death per entry cannot describe the sample."""


def deaths_from_rounds(records: Sequence[dict], num_layers: int, num_kv_heads: int, length: int,
                       buffer: int) -> Tensor:
    """[layers, kv_heads, length] int32 death times from one sample's round records.

    records: audit-log lines of one request ({query_position, kept: [layers][kv_heads][K]} per round;
    {reset_row} for a rebuilt cache), any order. At the round with query_position q every cached entry
    (positions <= q) that is neither kept nor among the r newest (q - r < j) dies at q + 1.
    Raises RebuiltCacheError when a reset follows a round, or a round keeps an entry that had died."""
    deaths = torch.full((num_layers, num_kv_heads, length), NEVER, dtype=torch.int32)
    rounds = sorted((r for r in records if "kept" in r), key=lambda r: r["query_position"])
    first_round = rounds[0]["query_position"] if rounds else None
    for r in records:
        if "reset_row" in r and first_round is not None and r["reset_row"] > first_round:
            raise RebuiltCacheError(f"the cache was rebuilt at row {r['reset_row']} after a round at "
                                    f"{first_round}: evicted entries came back")
    pos = torch.arange(length)
    for r in rounds:
        q = int(r["query_position"])
        if q >= length:
            break                                   # a round after the last position scored
        kept = torch.as_tensor(r["kept"], dtype=torch.long)                     # [L, H, K]
        held = torch.zeros(num_layers, num_kv_heads, length, dtype=torch.bool)
        held.scatter_(2, kept.clamp(max=length - 1), kept < length)
        held |= pos > q - buffer                    # the buffer and everything not yet cached
        alive = deaths == NEVER
        if bool((held & ~alive).any()):
            raise RebuiltCacheError(f"the round at {q} keeps entries that had died: the cache was rebuilt")
        deaths.masked_fill_(alive & ~held, q + 1)
    return deaths


def visibility(deaths: Tensor) -> Tensor:
    """[..., N, N] bool from deaths [..., N]: may query row i read key column j (j <= i < deaths[j])."""
    n = deaths.shape[-1]
    i = torch.arange(n, device=deaths.device).view(n, 1)
    j = torch.arange(n, device=deaths.device).view(1, n)
    return (j <= i) & (i < deaths.unsqueeze(-2))


def place_in_batch(records: Sequence[Tensor | None], width: int, offsets: Sequence[int] | None = None, *,
                   num_layers: int | None = None, num_kv_heads: int | None = None) -> Tensor:
    """[B, layers, kv_heads, width] int32 for a padded batch: sample b's position p sits in column
    offsets[b] + p (left padding; 0 for right padding), and so do its death times. None: a sample under
    full attention. Columns outside a sample stay NEVER: padding is the attention mask's job."""
    offsets = list(offsets) if offsets is not None else [0] * len(records)
    shapes = {tuple(r.shape[:2]) for r in records if r is not None}
    if num_layers is None or num_kv_heads is None:
        if len(shapes) != 1:
            raise ValueError("give num_layers and num_kv_heads when no sample (or samples of several shapes) has a record")
        num_layers, num_kv_heads = shapes.pop()
    out = torch.full((len(records), num_layers, num_kv_heads, width), NEVER, dtype=torch.int32)
    for b, (rec, off) in enumerate(zip(records, offsets)):
        if rec is None:
            continue
        n = rec.shape[-1]
        if off + n > width:
            raise ValueError(f"sample {b}: {n} positions at offset {off} do not fit width {width}")
        rec = rec.to(torch.int32)
        out[b, :, :, off : off + n] = torch.where(rec == NEVER, rec, rec + off)
    return out


def record_bytes(deaths: Tensor) -> int:
    """Bytes of one dense record (what a sample carries when its record is sent, not re-derived)."""
    return deaths.numel() * deaths.element_size()
