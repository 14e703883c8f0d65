"""Tensor helpers the policies share (no policy state): index complements, window attention, unit rows,
per-row top-k masks. The interface every policy implements lives in `base.py`.

Shapes as in `base.py`: H = KV heads, S = candidates, d = head_dim, w = window queries, r = buffer keys,
G = query heads per KV head.
"""

from __future__ import annotations

import torch
from torch import Tensor


def complement(index: Tensor, size: int) -> Tensor:
    """Per row, the ascending indices in [0, size) that `index` does not name (rows have equal counts)."""
    rows = index.shape[0]
    mask = torch.ones(rows, size, dtype=torch.bool, device=index.device)
    mask.scatter_(1, index, False)
    return mask.nonzero()[:, 1].view(rows, size - index.shape[1])


def grouped_window_attention(keys: Tensor, queries: Tensor, buffer_keys: Tensor | None = None, *,
                             positions: Tensor | None = None, query_position: int | None = None) -> Tensor:
    """[H, S]: attention the window queries put on each candidate, summed over the window and averaged
    over each KV head's query group. Softmax and causal mask as in `window_attention`."""
    return window_attention(keys, queries, buffer_keys, positions=positions, query_position=query_position).sum(dim=2).mean(dim=1)


def window_attention(keys: Tensor, queries: Tensor, buffer_keys: Tensor | None = None, *,
                     positions: Tensor | None = None, query_position: int | None = None) -> Tensor:
    """[H, G, w, S]: causal softmax attention of every window query on each candidate.

    keys [H, S, d] (candidates), queries [H·G, w, d] (the w newest tokens' queries, chronological; any
    strides), buffer_keys [H, r, d] (the r newest tokens' keys, chronological) or None. Softmax runs over
    the candidates plus the buffer keys when given. Causal, as the model's own attention (SnapKV's
    α_i^(t'), kvpress's mask on the window): window query i, the (w−1−i)-th newest token, sees a key only
    if that key is not newer than itself. The newest query and the newest buffer key are the same token
    (the engines hand both ending at `query_position`), so query i does not see the last w−1−i buffer
    keys. Candidates are hidden by position only when `query_position` is given (positions [H, S]): a
    candidate is newer than window query i iff position > query_position − (w−1−i), which happens only
    when w exceeds the buffer. A query that sees no key at all (a window reaching below every candidate)
    puts 0 on every candidate. Without buffer keys and query_position nothing is masked.
    """
    H, S, d = keys.shape
    group, w = queries.shape[0] // H, queries.shape[1]
    # reshape, not view: a float32 window slice of a longer query store is non-contiguous (.float() does
    # not copy it), and view cannot merge its query-head and window dims; reshape copies only then.
    q = queries.float().reshape(H, group * w, d)
    k = keys.float()
    if buffer_keys is not None:
        k = torch.cat([k, buffer_keys.float()], dim=1)
    logits = q @ k.transpose(1, 2) / d**0.5  # [H, G*w, S + r]
    hidden = _newer_than_query(w, S, k.shape[1] - S, positions if query_position is not None else None,
                               query_position, keys.device)
    if hidden is None:
        return torch.softmax(logits, dim=-1)[:, :, :S].view(H, group, w, S)
    logits = logits.view(H, group, w, k.shape[1]).masked_fill_(hidden.unsqueeze(1), float("-inf"))
    return torch.softmax(logits, dim=-1)[..., :S].nan_to_num_(0.0)  # [H, G, w, S]; rows seeing nothing -> 0


def _newer_than_query(w: int, num_candidates: int, num_buffer: int, positions: Tensor | None,
                      query_position: int | None, device) -> Tensor | None:
    """[H or 1, w, S + r] bool, True where the key is newer than window query i. Ages count back from the
    newest token: query i has age w−1−i, buffer key j age r−1−j, a candidate query_position − position
    (older than every query when positions are not given). None when nothing can be hidden."""
    if positions is None and (num_buffer == 0 or w == 1):
        return None
    query_age = torch.arange(w - 1, -1, -1, device=device).view(1, w, 1)
    if positions is None:
        cand_age = torch.full((1, 1, num_candidates), w, device=device)
    else:
        cand_age = (query_position - positions.to(device)).unsqueeze(1)          # [H, 1, S]
    buffer_age = torch.arange(num_buffer - 1, -1, -1, device=device).view(1, 1, num_buffer)
    key_age = torch.cat([cand_age, buffer_age.expand(cand_age.shape[0], 1, num_buffer)], dim=2)
    return key_age < query_age


def unit_rows(x: Tensor, eps: float = 1e-8) -> Tensor:
    """x / ||x|| along the last dim (float32 or wider); all-zero rows stay zero."""
    x = x.double() if x.dtype == torch.float64 else x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def top_per_row(scores: Tensor, counts: Tensor, eligible: Tensor) -> Tensor:
    """[H, S] bool: per row h, the counts[h] eligible entries with the largest scores (ties: lower index).
    Rows with fewer than counts[h] eligible entries get all of them."""
    ranked = scores.masked_fill(~eligible, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = ranked.argsort(dim=1)
    return (rank < counts.view(-1, 1)) & eligible
