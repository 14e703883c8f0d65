"""The attention function registered with transformers: causal attention under per-(layer, KV head)
death times, ``j <= i < deaths[b, layer, h, j]``, AND the model's own mask (padding).

Contract of the forward kwarg ``kvtier_deaths``: int tensor [B, layers, kv_heads, T], T the forward's
sequence length, in the batch's column coordinates (`record.place_in_batch`). Without it the layer runs
transformers' SDPA attention unchanged. A query row with nothing visible (padding) attends to itself, so
no row is all -inf; a real token always sees itself (an entry dies only after r >= 1 newer queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .record import NEVER

ATTN_NAME = "kvtier_deathtime"
DEATHS_KWARG = "kvtier_deaths"
# Which implementation runs full-sequence forwards per device type: "mask" (SDPA with a boolean mask,
# differentiable on CPU) or "flex" (FlexAttention over the death tensor, no [T, T] mask in memory).
BACKEND = {"cpu": "mask", "cuda": "flex"}
# The mask path runs queries in chunks of this many, each over the keys up to its last query: a boolean mask
# rules out SDPA's causal skipping, so one call would pay the whole [T, T] square and build its whole mask; in
# chunks it pays about the lower triangle (a 3.3k-token evicted row, CPU: 4.7-5.0 s -> 2.9 s, docs/reasoner.md).
# Same result up to summation order.
QUERY_CHUNK = 256


def register() -> str:
    """Register ``ATTN_NAME`` with transformers' attention and mask interfaces (idempotent); returns it.
    The mask interface is SDPA's, so the mask handed to the function is the model's causal + padding mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, deathtime_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


def layer_mask(deaths: Tensor, base: Tensor | None, q_len: int) -> Tensor:
    """[B, kv_heads, q_len, T] bool visibility of the last q_len queries for one layer: deaths [B, kv_heads, T]
    (its layer's slice); base: the model's bool mask broadcastable to [B, 1, q_len, T] (None: causal)."""
    T = deaths.shape[-1]
    i = torch.arange(T - q_len, T, device=deaths.device).view(q_len, 1)
    vis = (i < deaths.unsqueeze(-2)).tril_(T - q_len)          # [B, H, q, T]: alive at query i, and j <= i
    if base is not None:
        vis &= base.to(torch.bool)
    vis.diagonal(T - q_len, -2, -1).fill_(True)                # j == i (in place: fewer passes over [q, T])
    return vis


def deathtime_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query [B, Hq, q, d], key/value [B, H, T, d] (post-RoPE) -> ([B, q, Hq, d], None)."""
    deaths = kwargs.get(DEATHS_KWARG)
    if deaths is None and not kwargs.get("output_attentions"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, q_len, _ = query.shape
    H = key.shape[1]
    if deaths is None:                                # weights asked for under full attention
        deaths = torch.full((B, module.layer_idx + 1, H, key.shape[2]), NEVER, device=query.device)
    d_layer = deaths[:, module.layer_idx].to(query.device)                     # [B, H, T]
    if d_layer.shape != (B, H, key.shape[2]):
        raise ValueError(f"{DEATHS_KWARG} must be [B={B}, layers, kv_heads={H}, T={key.shape[2]}]; layer "
                         f"{module.layer_idx} has {tuple(d_layer.shape)}")
    if BACKEND.get(query.device.type) == "flex" and q_len == key.shape[2]:
        dev = query.device.type
        if torch.is_autocast_enabled(dev):            # SDPA casts under autocast; flex does not, and Qwen3's q/k norms
            low = torch.get_autocast_dtype(dev)        # leave q, k in fp32 beside a bf16 v
            query, key, value = query.to(low), key.to(low), value.to(low)
        return _flex(query, key, value, d_layer, attention_mask, scaling), None
    if kwargs.get("output_attentions"):               # the weights themselves: explicit fp32 softmax
        vis = layer_mask(d_layer, attention_mask, q_len).repeat_interleave(Hq // H, dim=1)   # [B, Hq, q, T]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        k = key.float().repeat_interleave(Hq // H, dim=1)
        w = torch.softmax((query.float() @ k.transpose(2, 3) * scale).masked_fill(~vis, float("-inf")), dim=-1)
        out = (w @ value.float().repeat_interleave(Hq // H, dim=1)).to(query.dtype)
        return out.transpose(1, 2).contiguous(), w
    drop = dropout if module.training else 0.0
    T, G = key.shape[2], Hq // H
    if attention_mask is not None and attention_mask.shape[-2] not in (1, q_len):
        raise ValueError(f"the model's mask has {attention_mask.shape[-2]} query rows; {q_len} queries")
    # query head h * G + g reads KV head h: the mask is built once per KV head and each of the G query heads
    # at stride G (a view) attends with it, so no [B, Hq, q, T] copy of the mask is made
    outs = []
    for a in range(0, q_len, QUERY_CHUNK):            # queries [a, b) see keys up to their last, T - q_len + b
        b = min(a + QUERY_CHUNK, q_len)
        end = T - q_len + b
        base = None if attention_mask is None else attention_mask[..., a:b, :end] if attention_mask.shape[-2] > 1 \
            else attention_mask[..., :end]
        vis = layer_mask(d_layer[..., :end], base, b - a)                       # [B, H, b - a, end]
        per_g = [F.scaled_dot_product_attention(query[:, g::G, a:b], key[:, :, :end], value[:, :, :end],
                                                attn_mask=vis, scale=scaling, dropout_p=drop) for g in range(G)]
        outs.append(torch.stack(per_g, dim=2).flatten(1, 2))                    # head h * G + g, as query's
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _flex(query, key, value, d_layer: Tensor, attention_mask, scaling) -> Tensor:
    """FlexAttention with a mask_mod reading the death tensor (no [T, T] mask in memory)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, Hq, T, _ = query.shape
    G = Hq // key.shape[1]
    pad = None
    if attention_mask is not None:                    # the model's [B, 1, T, T] bool mask: keep its key padding
        pad = attention_mask.to(torch.bool)[:, 0].any(dim=1)                    # [B, T] keys some query sees

    def kv_mask(b, h, q_idx, kv_idx):                 # h: the KV head
        ok = (kv_idx <= q_idx) & (q_idx < d_layer[b, h, kv_idx])
        if pad is not None:
            ok = ok & pad[b, kv_idx]
        return ok | (q_idx == kv_idx)

    block = kv_head_block_mask(kv_mask, B, key.shape[1], G, T, device=query.device,
                               compile=query.device.type == "cuda")
    cuda = query.device.type == "cuda"
    out = _compiled_flex()(query, key, value, block_mask=block, scale=scaling, enable_gqa=True) if cuda else \
        flex_attention(query, key, value, block_mask=block, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def kv_head_block_mask(kv_mask, B: int, H: int, G: int, T: int, *, device, compile: bool = False):
    """FlexAttention's BlockMask for B x (H * G) query heads from `kv_mask(b, kv_head, q, kv)`: the block
    sparsity is computed over the H KV heads (a G-th of the mask_mod evaluations) and its block tables are
    repeated for the G query heads of each group; the kernel's mask_mod, called with the query head h,
    reads KV head h // G (flex indexes block tables by query head, modulo their head count)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    kv_block = create_block_mask(kv_mask, B, H, T, T, device=device, _compile=compile)
    if G == 1:
        return kv_block

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_mask(b, h // G, q_idx, kv_idx)

    rep = lambda t: None if t is None else t.repeat_interleave(G, dim=1)     # [B, H, ...] block tables
    return BlockMask.from_kv_blocks(rep(kv_block.kv_num_blocks), rep(kv_block.kv_indices),
                                    rep(kv_block.full_kv_num_blocks), rep(kv_block.full_kv_indices),
                                    BLOCK_SIZE=kv_block.BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=kv_block.seq_lengths)


_COMPILED: list = []


def _compiled_flex():
    """FlexAttention compiled once per process (its eager form materialises the scores; on a GPU only the
    compiled kernel is the memory-efficient one). Not exercised on CPU, where the tests run it eagerly."""
    if not _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED[0]
