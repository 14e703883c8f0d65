"""`ReferenceEngine`: a Hugging Face causal LM that decodes batches of requests under per-sequence
eviction specs (the paper's setting, §4.1 and Appendix F), with forced (scripted) tokens and sampling."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from kvtier.policies.keyed_random import seed_key

from .attention import ATTN_NAME, register_attention
from .batch import DecodeBatch
from .cache import BatchKVCache
from .requests import Output, Request, SequenceState


def _sample_rows(logits: Tensor, temperature: float, top_p: float, gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [n, V]: greedy at temperature 0, else nucleus sampling with one uniform
    draw per row from that row's generator (inverse CDF over the sorted, truncated distribution)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sp, si = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        sp = sp.masked_fill(sp.cumsum(dim=-1) - sp > top_p, 0.0)
    cdf = sp.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=g) for g in gens]).to(cdf.device) * cdf[:, -1]
    j = torch.searchsorted(cdf, u.unsqueeze(1)).clamp(max=cdf.shape[1] - 1)
    return si.gather(1, j).squeeze(1).tolist()


def _cache_bound(r: Request) -> int:
    """Entries per head a request can ever hold: prompt + generated, bounded by max(prompt, K + 2r)."""
    total = len(r.prompt_ids) + max(r.max_new_tokens, len(r.forced or ()))
    return min(total, max(len(r.prompt_ids), r.spec.budget + 2 * r.spec.buffer)) if r.spec.compressed else total


class ReferenceEngine:
    """Load a Hugging Face causal LM with the eviction attention and generate under per-sequence specs.

        eng = ReferenceEngine(model_dir)
        outs = eng.generate([Request(ids, EvictionSpec(policy="random", budget=256, buffer=16, seed=0),
                                     max_new_tokens=512)])

    model: a model directory / HF id, or a loaded model (its attention implementation is switched).
    Defaults: cuda with bfloat16 when available, else cpu with float32."""

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None, device: str | None = None,
                 query_window: int = 8, manual_attention: bool = False):
        register_attention()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, attn_implementation=ATTN_NAME)
            model.to(device)
        else:
            model.config._attn_implementation = ATTN_NAME
            try:
                model.set_attn_implementation(ATTN_NAME)
            except Exception:  # older/newer transformers: the config attribute is what layers read
                pass
        model.eval()
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_q_heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.query_window = query_window
        self.manual_attention = manual_attention
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else cfg.eos_token_id
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))

    def new_batch(self, batch: int, capacity: int, *, track_attention=False, query_window=0, audit=None,
                  keep_records=True) -> DecodeBatch:
        """An empty `DecodeBatch` of `batch` rows, `capacity` entries per head."""
        cache = BatchKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                             q_heads=self.num_q_heads, dtype=self.dtype, device=self.device,
                             track_attention=track_attention, query_window=query_window)
        return DecodeBatch(self.model, cache, audit=audit, keep_records=keep_records,
                           manual_attention=self.manual_attention)

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], *, audit_log: str | Path | None = None, keep_records: bool = True,
                 max_batch: int | None = None) -> list[Output]:
        """Decode every request (batched, `max_batch` at a time); outputs in request order. Requests without
        a req_id get "ref-<index>"; audit_log: round records appended as JSON lines."""
        requests = list(requests)
        for i, r in enumerate(requests):
            if not r.req_id:
                r.req_id = f"ref-{i}"
        if max_batch is None or max_batch <= 0:
            max_batch = len(requests) or 1
        # Batch requests of similar cache bound together (a full-attention row sizes its whole batch).
        order = sorted(range(len(requests)), key=lambda i: (_cache_bound(requests[i]), i))
        outs: list[Output | None] = [None] * len(requests)
        fh = open(audit_log, "a", buffering=1) if audit_log else None
        try:
            for start in range(0, len(order), max_batch):
                idx = order[start : start + max_batch]
                for i, o in zip(idx, self._generate_batch([requests[i] for i in idx], fh, keep_records)):
                    outs[i] = o
        finally:
            if fh is not None:
                fh.close()
        return outs

    def _generate_batch(self, reqs: list[Request], audit, keep_records) -> list[Output]:
        policies = []
        for r in reqs:
            pol = r.spec.make_policy() if r.spec.compressed else None
            if pol is not None:
                pol.check_budget(r.spec.budget, len(r.prompt_ids))
            policies.append(pol)
        caps = [_cache_bound(r) for r in reqs]
        needs = set().union(*[p.needs for p in policies if p is not None]) if any(policies) else set()
        batch = self.new_batch(len(reqs), max(caps) + 1, track_attention="attention" in needs,
                               query_window=self.query_window if "queries" in needs else 0,
                               audit=audit, keep_records=keep_records)
        for b, (r, pol) in enumerate(zip(reqs, policies)):
            eg = torch.Generator(device=self.device)
            seed = r.spec.seed if r.spec.seed is not None else int.from_bytes(os.urandom(8), "little")
            eg.manual_seed(seed)
            sg = None
            if r.temperature > 0:
                sg = torch.Generator()
                sg.manual_seed(r.seed if r.seed is not None else torch.seed())
            batch.seqs[b] = SequenceState(r, r.spec, pol, len(r.prompt_ids), eg, sg, evict_key=seed_key(seed))
        # prefill (identical prompts once)
        by_prompt: dict[tuple, list[int]] = {}
        for b, r in enumerate(reqs):
            by_prompt.setdefault(tuple(r.prompt_ids), []).append(b)
        for prompt, rows in by_prompt.items():
            logits = batch.prefill(rows, list(prompt))
            self._choose_rows([batch.seqs[b] for b in rows], logits.unsqueeze(0).expand(len(rows), -1))
        while True:
            live = [b for b, s in enumerate(batch.seqs) if s.finished is None]
            if not live:
                break
            batch.run_rounds(batch.due_rows())
            toks = [batch.seqs[b].pending for b in live]
            pos = [batch.seqs[b].prompt_len + batch.seqs[b].decoded for b in live]
            logits = batch.step(live, toks, pos)
            for b in live:
                batch.seqs[b].decoded += 1
            self._choose_rows([batch.seqs[b] for b in live], logits)
        return [s.output() for s in batch.seqs]

    def _choose_rows(self, seqs: list[SequenceState], logits: Tensor) -> None:
        """Pick every row's next token (forced, greedy or sampled) and mark finished sequences."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        greedy = lp.argmax(dim=-1).tolist()
        toks: list[int | None] = [None] * len(seqs)
        by_setting: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            r, n = s.req, len(s.tokens)
            if r.forced is not None and n < len(r.forced):
                toks[i] = int(r.forced[n])
            elif r.temperature <= 0:
                toks[i] = greedy[i]
            else:
                by_setting.setdefault((r.temperature, r.top_p), []).append(i)
        for (temp, top_p), idx in by_setting.items():
            picked = _sample_rows(logits[idx], temp, top_p, [seqs[i].sample_gen for i in idx])
            for i, t in zip(idx, picked):
                toks[i] = t
        chosen = lp.gather(1, torch.tensor(toks, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        for i, s in enumerate(seqs):
            r, tok = s.req, toks[i]
            forced = r.forced is not None and len(s.tokens) < len(r.forced)
            s.tokens.append(tok)
            s.logprobs.append(chosen[i])
            s.argmax.append(greedy[i])
            s.pending = tok
            limit = max(r.max_new_tokens, len(r.forced or ()))
            if not forced and (tok in r.stop_ids or tok in self.eos_ids):
                s.finished = "stop"
            elif len(s.tokens) >= limit:
                s.finished = "length"
