"""The first layer's keys of a batch, for simulating a policy that reads only those (`random_line_reserve`).

A first-layer key is a function of the token and its position alone: embedding -> layer 0's input norm ->
k_proj -> k_norm (Qwen3; absent elsewhere) -> RoPE at the logical position. Nothing before it attends, so
eviction cannot change it, and a prefill computes what the engines cache for layer 0 decode step by decode
step (the reference engine's post-RoPE keys, the vLLM engine's paged cache; dtype aside). So a policy that
reads only these keys can be replayed without an engine (`simulate_deaths(..., first_keys=...)`), from the
current weights of a model being trained: a no-grad partial forward, a small fraction of one layer.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor


@torch.no_grad()
def first_layer_keys(model, ids: Tensor) -> Tensor:
    """[B, kv_heads, T, head_dim] float32, on `model`'s device: layer 0's post-RoPE keys of every token of
    `ids` [B, T] at positions 0..T-1 (right padding: a row's real tokens keep their keys; the padding's
    are computed and unused). `model`: a Hugging Face causal LM of the Llama / Qwen3 layout
    (model.model.embed_tokens, .layers[0].input_layernorm / .self_attn.k_proj [/ k_norm], .rotary_emb)."""
    inner = model.model
    layer = inner.layers[0]
    attn = layer.self_attn
    ids = ids.to(inner.embed_tokens.weight.device)
    B, T = ids.shape
    hidden = layer.input_layernorm(inner.embed_tokens(ids))
    keys = attn.k_proj(hidden).view(B, T, -1, attn.head_dim)
    if getattr(attn, "k_norm", None) is not None:
        keys = attn.k_norm(keys)
    keys = keys.transpose(1, 2)                                               # [B, H, T, d]
    positions = torch.arange(T, device=ids.device).unsqueeze(0).expand(B, T)
    cos, sin = inner.rotary_emb(hidden, positions)
    rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb   # the model's own RoPE
    _, keys = rope(keys, keys, cos, sin)
    return keys.float()
