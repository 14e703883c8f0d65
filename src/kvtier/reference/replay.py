"""Masked-attention replay in transformers: the oracle the compressed vLLM engine is tested against.

Feeds prompt + generated tokens through the Hugging Face model once, with an attention mask per
(layer, KV head) that replays the engine's logged keep-sets: the query at position p sees, in every
head, the positions that head held after the last round before p (kept candidates + the r-token
buffer) plus everything appended since. Full attention with evicted positions masked equals attention
over the compacted cache, so its log-probs must match the engine's up to numerical noise.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

ATTN_NAME = "kvtier_masked"
_CURRENT: dict = {}  # layer_idx -> additive mask [H_q, N, N] for the forward in progress


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    groups = module.num_key_value_groups
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling
    logits = logits + _CURRENT[module.layer_idx].unsqueeze(0)
    w = torch.softmax(logits, dim=-1)
    out = torch.matmul(w, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), w


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _masked_attention)


def visibility(num_layers: int, num_kv_heads: int, seq_len: int, records: list[dict], buffer: int) -> Tensor:
    """[layers, H, N, N] bool: may the query at row q read the key at column k.

    `records` are audit-log lines of one request: rounds ({query_position, kept}) apply from row
    query_position+1; resets ({reset_row}, a preemption) make rows from reset_row on see everything
    again (vLLM recomputes the whole sequence) until the next round.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    vis = causal.expand(num_layers, num_kv_heads, seq_len, seq_len).clone()
    events = sorted((((r["query_position"] + 1) if "kept" in r else r["reset_row"], r) for r in records),
                    key=lambda e: e[0])
    for i, (start, rec) in enumerate(events):
        end = min(events[i + 1][0] if i + 1 < len(events) else seq_len, seq_len)
        if start >= end or "kept" not in rec:
            continue  # a reset: rows keep plain causal attention
        qp = rec["query_position"]
        held = torch.zeros(num_layers, num_kv_heads, seq_len, dtype=torch.bool)
        kept = torch.tensor(rec["kept"], dtype=torch.long)           # [layers, H, K]
        held.scatter_(2, kept.clamp(max=seq_len - 1), True)
        held[:, :, max(qp - buffer + 1, 0) :] = True                 # the buffer and everything newer
        vis[:, :, start:end] &= held.unsqueeze(2)
    return vis


class MaskedReplay:
    """The transformers model of `model_dir` (float32 by default) with the masked attention."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        _register()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=ATTN_NAME)
        self.model.eval()
        cfg = self.model.config
        self.num_layers, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads

    @contextmanager
    def masked(self, vis: Tensor) -> Iterator[None]:
        """Forwards of `self.model` inside this block attend under `vis` ([layers, H_kv, N, N] bool, as
        `visibility` returns; N = the forward's sequence length)."""
        for layer in range(self.num_layers):
            m = vis[layer].repeat_interleave(self.group, dim=0)
            _CURRENT[layer] = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
        try:
            yield
        finally:
            _CURRENT.clear()

    @torch.no_grad()
    def logprobs(self, token_ids: list[int], prompt_len: int, rounds: list[dict], buffer: int,
                 vis: Tensor | None = None) -> Tensor:
        """Log-prob of each generated token (token_ids[prompt_len:]) under the replayed masks: [N - prompt_len]."""
        n = len(token_ids)
        if vis is None:
            vis = visibility(self.num_layers, self.num_kv_heads, n, rounds, buffer)
        with self.masked(vis):
            ids = torch.tensor([token_ids])
            logits = self.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        targets = ids[0, prompt_len:]
        return lp[prompt_len - 1 : n - 1].gather(1, targets.unsqueeze(1)).squeeze(1)
