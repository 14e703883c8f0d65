"""Masked-attention replay in transformers: the oracle the compressed vLLM engine is tested against.

Feeds prompt + generated tokens through the Hugging Face model once under the death-time attention of
kvtier.deathtime, with the deaths rebuilt from the engine's logged keep-sets: the query at position p
sees, in every head, what that head held after the last round before p (kept candidates + the r-token
buffer) plus everything appended since. Full attention with evicted positions masked equals attention
over the compacted cache, so its log-probs must match the engine's up to numerical noise.

A preempted or woken request's cache is rebuilt in full ({reset_row} records): rows from the reset on see
every position again until the rounds after it. One death per entry cannot say that, so the replay runs
one forward per segment between resets, each under the rounds of its own segment.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from kvtier.deathtime import ATTN_NAME, deaths_from_rounds, register


def segments(records: list[dict], length: int) -> list[tuple[int, int, list[dict]]]:
    """[(first_row, end_row, rounds)]: the rows between cache rebuilds and the rounds that apply to them
    (a round at query_position q applies from row q + 1)."""
    cuts = sorted({0} | {int(r["reset_row"]) for r in records if "reset_row" in r and 0 < r["reset_row"] < length})
    bounds = cuts + [length]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.append((a, b, [r for r in records if "kept" in r and a <= r["query_position"] + 1 < b]))
    return out


class MaskedReplay:
    """The transformers model of `model_dir` (float32 by default) under the death-time attention, on
    `device` (the CPU by default)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        register()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=ATTN_NAME)
        self.model.to(device).eval()
        self.device = torch.device(device)
        cfg = self.model.config
        self.num_layers, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads

    def deaths(self, records: list[dict], length: int, buffer: int) -> Tensor:
        """[layers, kv_heads, length] death times of records without a rebuild (deathtime.deaths_from_rounds)."""
        return deaths_from_rounds(records, self.num_layers, self.num_kv_heads, length, buffer)

    @torch.no_grad()
    def logits(self, token_ids: list[int], deaths: Tensor | None, **kwargs):
        """The model's forward over `token_ids` under `deaths` ([layers, kv_heads, N]; None: full attention)."""
        ids = torch.tensor([token_ids], device=self.device)
        extra = {} if deaths is None else {"kvtier_deaths": deaths.unsqueeze(0).to(self.device)}
        return self.model(input_ids=ids, **extra, **kwargs)

    @torch.no_grad()
    def logprobs(self, token_ids: list[int], prompt_len: int, rounds: list[dict], buffer: int) -> Tensor:
        """Log-prob of each generated token (token_ids[prompt_len:]) under the replayed rounds: [N - prompt_len]."""
        n = len(token_ids)
        rows = torch.empty(n, dtype=torch.float32)
        targets = torch.tensor(token_ids)
        for first, end, recs in segments(rounds, n):
            lo, hi = max(first, prompt_len - 1), min(end, n - 1)      # row i predicts token i + 1
            if lo >= hi:
                continue
            deaths = self.deaths(recs, n, buffer) if recs else None
            lp = torch.log_softmax(self.logits(token_ids, deaths).logits[0].float().cpu(), dim=-1)
            rows[lo:hi] = lp[lo:hi].gather(1, targets[lo + 1 : hi + 1].unsqueeze(1)).squeeze(1)
        return rows[prompt_len - 1 : n - 1]
