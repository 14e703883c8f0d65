"""One batch of sequences decoding together: prefill, one-token steps, and eviction rounds on schedule.

Every sequence advances one token per forward; each has its own prompt length, spec (budget, policy,
protection rule) and round cadence. Every round can be logged in the vLLM engine's audit format
({req_id, round, query_position, prompt_len, budget, buffer, policy, kept: [layers][kv_heads][K]}),
which `kvtier.reference.MaskedReplay` replays.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

from .attention import CacheAttention
from .cache import BatchKVCache
from .requests import SequenceState
from .rounds import round_due, select_evicted


class DecodeBatch:
    """Sequences decoding together over a `BatchKVCache` (what `ReferenceEngine.generate` drives;
    benchmarks may fill the cache and `seqs` directly and call `step` / `run_rounds`).

    seqs[b]: the `SequenceState` of cache row b (None: unused row). audit: a text file the round records
    are written to (JSON lines); keep_records: also keep them on each sequence."""

    def __init__(self, model, cache: BatchKVCache, *, audit=None, keep_records: bool = True,
                 manual_attention: bool = False):
        self.model, self.cache = model, cache
        self.audit, self.keep_records = audit, keep_records
        self.attention = CacheAttention(model, cache, manual=manual_attention)
        self.seqs: list[SequenceState | None] = [None] * cache.B
        # False: one eviction draw per sequence from its own generator (keep-sets identical to the vLLM
        # engine's for the same seed). True: order-free policies draw once for every sequence due at the
        # same step (faster; what a throughput benchmark wants).
        self.batched_draws = False

    @torch.no_grad()
    def prefill(self, rows: list[int], prompt_ids: list[int]) -> Tensor:
        """Prefill one prompt into every row of `rows` (identical prompts share the forward); returns the
        last-position logits [V]."""
        logits = self.attention.prefill(rows, prompt_ids)
        for b in rows:
            self.cache.lengths[b] = len(prompt_ids)
        return logits

    @torch.no_grad()
    def step(self, rows: list[int], tokens: list[int], logical_positions: list[int]) -> Tensor:
        """Feed one token per row through the decode path; returns logits [len(rows), V]."""
        logits = self.attention.decode(rows, tokens, logical_positions)
        for b in rows:
            self.cache.lengths[b] += 1
        return logits

    # -- rounds ----------------------------------------------------------------------------------
    def due_rows(self) -> list[int]:
        """Rows whose round is due before the next step appends."""
        return [b for b, s in enumerate(self.seqs)
                if s is not None and s.finished is None
                and round_due(s.spec, self.cache.lengths[b], s.decoded, s.rounds > 0)]

    @torch.no_grad()
    def run_rounds(self, rows: list[int]) -> None:
        """Evict now for every sequence in `rows` (grouped: same policy, schedule, length, prompt and position)."""
        if not rows:
            return
        c = self.cache
        groups: dict[tuple, list[int]] = {}
        for b in rows:
            s = self.seqs[b]
            # make_policy shares one instance between identical specs, so the instance stands for the
            # policy's name and parameters
            key = (id(s.policy), s.spec.budget, s.spec.buffer, c.lengths[b], s.prompt_len, s.prompt_len + s.decoded - 1)
            groups.setdefault(key, []).append(b)
        for grp in groups.values():
            self._round_group(grp)

    def _round_group(self, rows: list[int]) -> None:
        c = self.cache
        s0 = self.seqs[rows[0]]
        spec = s0.spec
        qp = s0.prompt_len + s0.decoded - 1
        evicted = select_evicted(c, self.seqs, rows, batched_draws=self.batched_draws)
        new_len = c.apply_round(rows, evicted)
        for b in rows:
            s = self.seqs[b]
            s.rounds += 1
            if self.keep_records or self.audit is not None:
                rec = dict(req_id=s.req.req_id, round=s.rounds, query_position=qp, prompt_len=s.prompt_len,
                           budget=spec.budget, buffer=spec.buffer, policy=spec.policy_name,
                           kept=c.kept_positions(b, spec.buffer).tolist())
                if self.keep_records:
                    s.records.append(rec)
                if self.audit is not None:
                    self.audit.write(json.dumps(rec, separators=(",", ":")) + "\n")
        assert new_len == spec.schedule().settled_len
