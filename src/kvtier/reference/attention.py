"""The reference engine's attention: a transformers attention function over a `BatchKVCache`.

The model runs with ``use_cache=False``; the function registered as ``ATTN_NAME`` appends each forward's
post-RoPE keys/values to the cache (RoPE positions logical, slots physical, as in the vLLM engine) and
attends over what the cache holds. Which cache and which rows a forward writes is set up by the
`CacheAttention` that runs it (`prefill` / `decode`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvtier.policies import PolicyError

from .cache import BatchKVCache

ATTN_NAME = "kvtier_evict"
_ACTIVE: list["CacheAttention"] = []     # the attention whose forward is in progress


def _attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"attention {ATTN_NAME!r} called outside a kvtier reference forward")
    return _ACTIVE[-1].attend(module.layer_idx, query, key, value, scaling)


def register_attention() -> None:
    """Register ``ATTN_NAME`` with transformers (idempotent); load models with attn_implementation=ATTN_NAME."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


class CacheAttention:
    """Prefill and decode forwards of `model` over `cache`.

    sdpa_decode: fused SDPA for decode steps where every row has the same length (GPU default; otherwise
    the explicit grouped softmax, which is also what the CPU tests compare against the masked replay).
    manual: prefill by the explicit softmax too (always when the cache accumulates attention)."""

    def __init__(self, model, cache: BatchKVCache, *, manual: bool = False):
        self.model, self.cache, self.manual = model, cache, manual
        self.sdpa_decode = cache.device.type == "cuda"
        # what the forward in progress writes and reads (set by prefill / decode)
        self._prefilling = False
        self._prefill_rows: list[int] = []
        self._rows: Tensor | None = None          # None: every row of the cache, in order
        self._slots: Tensor | None = None         # [n] the slot each row appends at
        self._maxlen = 0
        self._same_slot: int | None = None        # every row appends at this slot
        self._valid: Tensor | None = None         # [n, maxlen] readable slots; None: all
        self._write_index = None

    # -- forwards --------------------------------------------------------------------------------
    def _forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        _ACTIVE.append(self)
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        finally:
            _ACTIVE.pop()
        return out.logits[:, -1].float()

    def prefill(self, rows: list[int], prompt_ids: list[int]) -> Tensor:
        """Write one prompt into slots [0, P) of every row in `rows`; last-position logits [V]. The caller
        sets the rows' lengths."""
        c = self.cache
        self._prefilling, self._prefill_rows = True, list(rows)
        try:
            ids = torch.tensor([prompt_ids], device=c.device)
            pos = torch.arange(len(prompt_ids), device=c.device).unsqueeze(0)
            return self._forward(ids, pos)[0]
        finally:
            self._prefilling = False

    def decode(self, rows: list[int], tokens: list[int], logical_positions: list[int]) -> Tensor:
        """Append one token per row at its slot `cache.lengths[b]`; logits [len(rows), V]. The caller
        advances the lengths."""
        c = self.cache
        dev = c.device
        all_rows = len(rows) == c.B and rows == list(range(c.B))
        self._rows = None if all_rows else torch.tensor(rows, device=dev)
        lens = [c.lengths[b] for b in rows]
        if max(lens) >= c.cap:
            raise PolicyError(f"cache capacity {c.cap} exceeded")
        self._slots = torch.tensor(lens, device=dev)
        self._maxlen = max(lens) + 1
        same = min(lens) == max(lens)
        self._same_slot = lens[0] if same else None
        self._valid = None if same else torch.arange(self._maxlen, device=dev).unsqueeze(0) <= self._slots.unsqueeze(1)
        b_ix = (self._rows if self._rows is not None else torch.arange(len(rows), device=dev)).unsqueeze(1)
        h_ix = torch.arange(c.H, device=dev).unsqueeze(0)
        self._write_index = (b_ix, h_ix)
        lp = torch.tensor(logical_positions, device=dev)
        if same and self._rows is None:
            c.positions[:, :, :, lens[0]] = lp.view(1, -1, 1)
        else:
            c.positions[:, b_ix, h_ix, self._slots.unsqueeze(1)] = lp.unsqueeze(1)
        ids = torch.tensor(tokens, device=dev).unsqueeze(1)
        pos = torch.tensor(logical_positions, device=dev).unsqueeze(1)
        return self._forward(ids, pos)

    # -- the attention function --------------------------------------------------------------------
    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling):
        """query [n, Hq, t, d], key/value [n, H, t, d] (post-RoPE) -> ([n, t, Hq, d], None)."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self._prefilling:
            return self._attend_prefill(layer, query, key, value, scale)
        return self._attend_decode(layer, query, key, value, scale)

    def _attend_decode(self, layer, query, key, value, scale):
        c = self.cache
        rows, slots = self._rows, self._slots                                  # [n], [n]
        n = query.shape[0]
        kc, vc = c.keys[layer], c.values[layer]
        if self._same_slot is not None and rows is None:                       # every row appends at one slot
            kc[:, :, self._same_slot] = key[:, :, 0].to(kc.dtype)
            vc[:, :, self._same_slot] = value[:, :, 0].to(vc.dtype)
        else:
            b_ix, h_ix = self._write_index
            kc[b_ix, h_ix, slots.unsqueeze(1)] = key[:, :, 0].to(kc.dtype)
            vc[b_ix, h_ix, slots.unsqueeze(1)] = value[:, :, 0].to(vc.dtype)
        m = self._maxlen
        if rows is None:
            k, v = kc[:, :, :m], vc[:, :, :m]
        else:
            k, v = kc.index_select(0, rows)[:, :, :m], vc.index_select(0, rows)[:, :, :m]
        valid = self._valid                                                     # [n, m] or None (all valid)
        if c.queries is not None:
            qbuf = c.queries[layer]
            sel = qbuf if rows is None else qbuf.index_select(0, rows)
            upd = torch.cat([sel[:, :, 1:], query.float()], dim=2)
            if rows is None:
                qbuf.copy_(upd)
            else:
                qbuf.index_copy_(0, rows, upd)
        if valid is None and c.attention is None and self.sdpa_decode:
            # Equal lengths, no weights needed: fused attention (flash decoding on GPU), GQA without repeat.
            try:
                out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype), scale=scale,
                                                     enable_gqa=True)
                return out.transpose(1, 2).contiguous(), None
            except RuntimeError:
                self.sdpa_decode = False
        # Decode attention for one query per row, grouped per KV head (no K/V repeat): logits in the cache
        # dtype, softmax in float32; masked slots are beyond each row's physical length.
        G = query.shape[1] // c.H
        qg = query.reshape(n, c.H, G, query.shape[-1]).to(k.dtype)
        logits = torch.matmul(qg, k.transpose(2, 3)).float() * scale                   # [n, H, G, m]
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        w = torch.softmax(logits, dim=-1)
        out = torch.matmul(w.to(v.dtype), v).reshape(n, c.H * G, 1, -1).to(query.dtype)
        if c.attention is not None:
            acc = c.attention[layer]
            inc = w.mean(dim=2)                                                         # [n, H, m]
            if rows is None:
                acc[:, :, :m] += inc
            else:
                acc.index_add_(0, rows, F.pad(inc, (0, acc.shape[-1] - m)))
        return out.transpose(1, 2).contiguous(), None

    def _attend_prefill(self, layer, query, key, value, scale):
        c = self.cache
        rows = self._prefill_rows
        P = key.shape[2]
        for b in rows:
            c.keys[layer][b, :, :P] = key[0].to(c.keys[layer].dtype)
            c.values[layer][b, :, :P] = value[0].to(c.values[layer].dtype)
            c.positions[layer, b, :, :P] = torch.arange(P, device=c.device)
        if c.queries is not None:
            w = c.query_window
            t = min(P, w)
            q = query[0, :, P - t:].float()
            for b in rows:
                buf = c.queries[layer][b]
                buf[:, : w - t] = buf[:, t:].clone()
                buf[:, w - t:] = q
        if c.attention is not None or self.manual:
            G = query.shape[1] // c.H
            k = key.float().repeat_interleave(G, dim=1)
            v = value.float().repeat_interleave(G, dim=1)
            logits = (query.float() @ k.transpose(2, 3)) * scale
            causal = torch.ones(P, P, dtype=torch.bool, device=c.device).tril()
            w = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)        # [1, Hq, P, P]
            out = (w @ v).to(query.dtype)
            if c.attention is not None:
                inc = w[0].sum(dim=1).view(c.H, G, P).mean(dim=1)                      # [H, P]
                for b in rows:
                    c.attention[layer][b, :, :P] = inc
        else:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
