"""A transformers reference engine that evicts with the compressed engine's schedule (no paging).

It is the paper's setting (§4.1, Appendix F: batched decoding in Hugging Face transformers, keys stored
post-RoPE, per-KV-head physical eviction) and the oracle the vLLM engine is tested against:

* one dense cache per layer, ``[B, H_kv, capacity, d]`` (`BatchKVCache`), filled by a custom attention
  function registered through transformers' ``AttentionInterface``; the model runs with
  ``use_cache=False`` and the function appends each step's post-RoPE key/value to the cache and attends
  over it. RoPE positions are logical (``position_ids``), slots are physical, exactly as in the engine;
* the schedule is the engine's (``EvictionSchedule.due``, as kvtier.engine.scheduler_side calls it);
  every KV head of every layer keeps K candidates (everything outside the r newest), so a head never
  holds more than K + 2r;
* compaction is kvtier.policies' hole filling; ``random`` draws its victims with the engine's
  counter-based keys (``keyed_random.keyed_victims``: seed, round, layer, KV head), so with the same
  eviction seed both engines produce the same keep-sets; other order-free read-nothing policies draw once
  per sequence for all layers and heads from a per-sequence generator;
* every round can be logged in the engine's audit format ({req_id, round, query_position, prompt_len,
  budget, buffer, policy, kept: [layers][kv_heads][K]}) and replayed by kvtier.models.reference.

Batched decoding: all sequences advance one token per forward; each has its own prompt length, budget,
policy, protection rule and round cadence. Identical prompts are prefilled once and copied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvtier.policies import EvictionContext, EvictionPolicy, EvictionSchedule, PolicyError, hole_fill_plan, make_policy
from kvtier.policies.keyed_random import keyed_victims, seed_key
from kvtier.policies.random import RandomPolicy

ATTN_NAME = "kvtier_evict"
_ACTIVE: list["DecodeBatch"] = []        # the batch whose forward is in progress (attention reads it)

# Policies whose rows are independent (a row = one KV head of one sequence): their rounds for several
# sequences due at the same step run as one call with B*H rows. Policies with per-(layer, head) state
# (triattention's calibration, diverse's profiles) run per sequence.
ROW_BATCHABLE = frozenset({"snapkv", "rkv", "vase", "h2o", "recency", "streaming", "random", "random_shared",
                           "random_block"})


# ----------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class EvictSpec:
    """What one sequence runs with; budget=None is full attention. `policy` is a registered name or a
    policy instance (probes pass pinned policies that are not in the registry)."""

    policy: Any = "random"
    budget: int | None = None
    buffer: int = 64
    protect_prompt: bool | None = None
    sinks: int | None = None
    seed: int | None = None
    params: tuple = ()                 # ((key, value), ...) extra policy parameters

    @property
    def compressed(self) -> bool:
        return self.budget is not None

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else getattr(self.policy, "name", type(self.policy).__name__)

    def schedule(self) -> EvictionSchedule:
        return EvictionSchedule(budget=self.budget, buffer=self.buffer)

    def make_policy(self) -> EvictionPolicy:
        if not isinstance(self.policy, str):
            return self.policy
        kw = dict(self.params)
        if self.protect_prompt is not None:
            kw["protect_prompt"] = self.protect_prompt
        if self.sinks is not None:
            kw["sinks"] = self.sinks
        return make_policy(self.policy, **kw)

    def group_key(self) -> tuple:
        pol = self.policy if isinstance(self.policy, str) else id(self.policy)
        return (pol, self.budget, self.buffer, self.protect_prompt, self.sinks, self.params)

    def extra_args(self) -> dict:
        """The same request for the vLLM engine (`SamplingParams.extra_args`), or {} for full attention."""
        if not self.compressed:
            return {}
        if not isinstance(self.policy, str):
            raise PolicyError("a policy instance cannot be sent to the vLLM engine; use a registered name")
        out = {"kvtier_budget": self.budget, "kvtier_policy": self.policy, "kvtier_buffer": self.buffer}
        if self.protect_prompt is not None:
            out["kvtier_protect_prompt"] = self.protect_prompt
        if self.sinks is not None:
            out["kvtier_sinks"] = self.sinks
        if self.seed is not None:
            out["kvtier_seed"] = self.seed
        if self.params:
            out["kvtier_params"] = dict(self.params)
        return out


def round_due(spec: EvictSpec, physical: int, decoded: int, after_round: bool = False) -> bool:
    """The compressed engine's trigger (`EvictionSchedule.due`, as scheduler_side.plan calls it), checked
    before a decode step appends."""
    if not spec.compressed:
        return False
    return spec.schedule().due(physical, decoded, after_round)


def round_schedule(prompt_len: int, total_len: int, spec: EvictSpec) -> list[int]:
    """query_position of every round a sequence of `total_len` tokens (prompt + fed tokens) goes through."""
    out, physical = [], prompt_len
    for pos in range(prompt_len, total_len):
        decoded = pos - prompt_len
        if round_due(spec, physical, decoded, bool(out)):
            out.append(pos - 1)
            physical = spec.schedule().settled_len
        physical += 1
    return out


# ----------------------------------------------------------------------------------------------- cache
class BatchKVCache:
    """Per-layer dense caches for B sequences, per KV head: keys[l], values[l]: [B, H, cap, d];
    positions: [L, B, H, cap] logical position held by each slot (-1 = empty); lengths [B] physical
    entries per head (every head of a sequence holds the same count). Optional per-slot state moves with
    its entry: accumulated attention (H2O) and a ring of the w most recent post-RoPE queries per layer."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, *, q_heads: int,
                 dtype=torch.float32, device="cpu", track_attention: bool = False, query_window: int = 0):
        self.L, self.B, self.H, self.d, self.cap, self.Hq = layers, batch, kv_heads, head_dim, capacity, q_heads
        self.device = torch.device(device)
        self.keys = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.positions = torch.full((layers, batch, kv_heads, capacity), -1, dtype=torch.long, device=device)
        self.lengths = [0] * batch
        self.attention = ([torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=device)
                           for _ in range(layers)] if track_attention else None)
        self.query_window = query_window
        self.queries = ([torch.zeros(batch, q_heads, query_window, head_dim, dtype=torch.float32, device=device)
                         for _ in range(layers)] if query_window else None)

    def bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.keys + self.values) + self.positions.numel() * 8
        return n

    def kept_positions(self, b: int, buffer: int) -> Tensor:
        """[L, H, n - r] logical positions held outside the buffer, ascending."""
        n = self.lengths[b]
        return self.positions[:, b, :, :n].sort(dim=-1).values[:, :, : max(n - buffer, 0)]

    def apply_round(self, rows: list[int], evicted: Tensor) -> int:
        """evicted: [L, len(rows), H, e] slots (ascending per head) of sequences that all hold n entries.
        Hole filling: surviving tail entries move into the holes. Returns the new length."""
        L, nb, H, e = evicted.shape
        n = self.lengths[rows[0]]
        dev = self.device
        b_idx = torch.tensor(rows, device=dev).repeat_interleave(H).unsqueeze(1).expand(nb * H, e)
        h_idx = torch.arange(H, device=dev).repeat(nb).unsqueeze(1).expand(nb * H, e)
        new_len = n - e
        for l in range(L):
            plan = hole_fill_plan(evicted[l].reshape(nb * H, e).to(dev), n)
            src, dst = plan.src, plan.dst
            for t in (self.keys[l], self.values[l], self.positions[l]) + (
                    (self.attention[l],) if self.attention is not None else ()):
                t[b_idx, h_idx, dst] = t[b_idx, h_idx, src]
        rows_t = torch.tensor(rows, device=dev)
        self.positions[:, rows_t, :, new_len:n] = -1
        if self.attention is not None:
            for l in range(L):
                self.attention[l][rows_t, :, new_len:n] = 0
        for b in rows:
            self.lengths[b] = new_len
        return new_len


# ----------------------------------------------------------------------------------------------- attention
def _attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"attention {ATTN_NAME!r} called outside a kvtier DecodeBatch forward")
    return _ACTIVE[-1].attend(module.layer_idx, query, key, value, scaling)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


# ----------------------------------------------------------------------------------------------- requests
@dataclass
class Request:
    prompt_ids: list[int]
    spec: EvictSpec = field(default_factory=EvictSpec)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None                # sampling seed
    forced: list[int] | None = None        # scripted tokens fed through the decode path before sampling
    stop_ids: tuple[int, ...] = ()
    req_id: str = ""


@dataclass
class Output:
    req_id: str
    prompt_len: int
    token_ids: list[int]
    logprobs: list[float]                  # log-prob of each emitted (or forced) token
    argmax: list[int]                      # greedy choice at each step (what greedy decoding would emit)
    finish_reason: str                     # "stop" | "length"
    rounds: int
    records: list[dict]                    # audit records of this sequence (when keep_records)


@dataclass
class _Seq:
    req: Request
    spec: EvictSpec
    policy: EvictionPolicy | None
    prompt_len: int
    evict_gen: torch.Generator
    sample_gen: torch.Generator | None
    evict_key: int = 0                     # the engine's counter-based key for `random` (keyed_random.seed_key)
    pending: int = -1                      # next token to feed (sampled or forced, not yet cached)
    decoded: int = 0                       # tokens fed through the decode path (cached)
    rounds: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)
    finished: str | None = None
    records: list[dict] = field(default_factory=list)


class DecodeBatch:
    """One batch of sequences decoding together over a `BatchKVCache` (what `ReferenceEngine.generate`
    drives; benchmarks may fill the cache directly and call `step`)."""

    def __init__(self, model, cache: BatchKVCache, *, audit=None, keep_records: bool = True,
                 manual_attention: bool = False):
        self.model, self.cache = model, cache
        self.audit, self.keep_records = audit, keep_records
        self.manual_attention = manual_attention
        self.seqs: list[_Seq | None] = [None] * cache.B
        # forward state read by the attention function
        self._mode = "decode"
        self._rows: Tensor | None = None
        self._slots: Tensor | None = None
        self._prefill_rows: list[int] = []
        self._same_slot: int | None = None
        self._valid: Tensor | None = None
        self._write_index = None
        # False: one eviction draw per sequence from its own generator (keep-sets identical to the vLLM
        # engine's for the same seed). True: order-free policies draw once for every sequence due at the
        # same step (faster; what a throughput benchmark wants).
        self.batched_draws = False
        # Fused SDPA for decode steps where every row has the same length (GPU default; the explicit
        # grouped softmax otherwise, which is also what the CPU tests compare against the masked replay).
        self.sdpa_decode = cache.device.type == "cuda"

    # -- attention -------------------------------------------------------------------------------
    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling):
        c = self.cache
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self._mode == "prefill":
            return self._attend_prefill(layer, query, key, value, scale)
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
        if c.attention is not None or self.manual_attention:
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

    # -- forward ----------------------------------------------------------------------------------
    def _forward(self, ids: Tensor, pos: Tensor) -> Tensor:
        _ACTIVE.append(self)
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        finally:
            _ACTIVE.pop()
        return out.logits[:, -1].float()

    @torch.no_grad()
    def prefill(self, rows: list[int], prompt_ids: list[int]) -> Tensor:
        """Prefill one prompt into every row of `rows` (identical prompts share the forward); returns the
        last-position logits [V]."""
        c = self.cache
        self._mode, self._prefill_rows = "prefill", list(rows)
        try:
            ids = torch.tensor([prompt_ids], device=c.device)
            pos = torch.arange(len(prompt_ids), device=c.device).unsqueeze(0)
            logits = self._forward(ids, pos)[0]
        finally:
            self._mode = "decode"
        for b in rows:
            c.lengths[b] = len(prompt_ids)
        return logits

    @torch.no_grad()
    def step(self, rows: list[int], tokens: list[int], logical_positions: list[int]) -> Tensor:
        """Feed one token per row through the decode path; returns logits [len(rows), V]."""
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
        logits = self._forward(ids, pos)
        for b in rows:
            c.lengths[b] += 1
        return logits

    # -- rounds ----------------------------------------------------------------------------------
    def due_rows(self) -> list[int]:
        return [b for b, s in enumerate(self.seqs)
                if s is not None and s.finished is None
                and round_due(s.spec, self.cache.lengths[b], s.decoded, s.rounds > 0)]

    @torch.no_grad()
    def run_rounds(self, rows: list[int]) -> None:
        """Evict now for every sequence in `rows` (grouped: same spec, length, prompt and position)."""
        if not rows:
            return
        c = self.cache
        groups: dict[tuple, list[int]] = {}
        for b in rows:
            s = self.seqs[b]
            key = (s.spec.group_key(), c.lengths[b], s.prompt_len, s.prompt_len + s.decoded - 1)
            groups.setdefault(key, []).append(b)
        for grp in groups.values():
            self._round_group(grp)

    def _round_group(self, rows: list[int]) -> None:
        c = self.cache
        s0 = self.seqs[rows[0]]
        spec, policy = s0.spec, s0.policy
        sched = spec.schedule()
        n = c.lengths[rows[0]]
        n_cand = sched.num_candidates(n)
        qp = s0.prompt_len + s0.decoded - 1
        base = dict(budget=sched.budget, prompt_len=s0.prompt_len, query_position=qp)
        L, H = c.L, c.H
        rows_t = torch.tensor(rows, device=c.device)
        if type(policy) is RandomPolicy:
            # the vLLM engine's draw (worker_side._select_keyed): keyed by (seed, round, layer, KV head)
            evicted = keyed_victims(
                torch.tensor([self.seqs[b].evict_key for b in rows], device=c.device),
                torch.tensor([self.seqs[b].rounds + 1 for b in rows], device=c.device), L,
                torch.arange(H, device=c.device), torch.full((len(rows),), policy.protected_len(s0.prompt_len),
                                                             device=c.device),
                n_cand, sched.num_evicted(n)).transpose(0, 1)                  # [L, nb, H, e]
        elif policy.order_free and not policy.needs and self.batched_draws:
            cand = c.positions[:, rows_t, :, :n_cand].reshape(L * len(rows) * H, n_cand)
            ctx = EvictionContext(positions=cand, generator=self.seqs[rows[0]].evict_gen, **base)
            evicted = policy.evict(ctx).view(L, len(rows), H, -1)
        elif policy.order_free and not policy.needs:
            ev = []
            for b in rows:                                  # one draw per sequence for all layers (engine-identical)
                cand = c.positions[:, b, :, :n_cand].reshape(L * H, n_cand)
                ctx = EvictionContext(positions=cand, generator=self.seqs[b].evict_gen, **base)
                ev.append(policy.evict(ctx).view(L, H, -1))
            evicted = torch.stack(ev, dim=1)                # [L, nb, H, e]
        else:
            chunks = [rows] if (policy.name in ROW_BATCHABLE and len(rows) > 1) else [[b] for b in rows]
            # what the engine hands a policy: + the buffer's keys when it reads them (optionally), and
            # the min(seen, w) newest queries, chronological
            with_buffer = "buffer_keys" in (policy.needs | getattr(policy, "optional", frozenset()))
            n_q = min(qp + 1, c.query_window) if c.queries is not None else 0
            per_chunk = []
            for chunk in chunks:
                nb = len(chunk)
                idx = torch.tensor(chunk, device=c.device)
                layers = []
                for l in range(L):
                    cand = c.positions[l].index_select(0, idx)[:, :, :n_cand].reshape(nb * H, n_cand)
                    order = cand.argsort(dim=1)
                    def gather(t: Tensor) -> Tensor:
                        t = t.index_select(0, idx)[:, :, :n_cand].reshape(nb * H, n_cand, *t.shape[3:])
                        return t.gather(1, order.view(nb * H, n_cand, *([1] * (t.dim() - 2))).expand_as(t))
                    ctx = EvictionContext(
                        positions=cand.gather(1, order),
                        keys=gather(c.keys[l]) if "keys" in policy.needs else None,
                        values=gather(c.values[l]) if "values" in policy.needs else None,
                        buffer_keys=(c.keys[l].index_select(0, idx)[:, :, n_cand:n].reshape(nb * H, n - n_cand, c.d)
                                     if with_buffer else None),
                        queries=(c.queries[l].index_select(0, idx)[:, :, c.query_window - n_q:]
                                 .reshape(nb * c.Hq, n_q, c.d)
                                 if "queries" in policy.needs and c.queries is not None else None),
                        attention=gather(c.attention[l]) if "attention" in policy.needs and c.attention is not None else None,
                        generator=self.seqs[chunk[0]].evict_gen,
                        extras={"layer": l, "num_layers": L}, **base)
                    ev = order.gather(1, policy.evict(ctx)).sort(dim=1).values      # [nb*H, e]
                    layers.append(ev.view(nb, H, -1))
                per_chunk.append(torch.stack(layers))                              # [L, nb, H, e]
            evicted = torch.cat(per_chunk, dim=1)
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
        assert new_len == sched.settled_len


# ----------------------------------------------------------------------------------------------- engine
def _sample_rows(logits: Tensor, temperature: float, top_p: float, gens: list[torch.Generator | None]) -> list[int]:
    """One token per row: greedy at temperature 0, else nucleus sampling with one uniform draw per row from
    that row's generator (inverse CDF over the sorted, truncated distribution)."""
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


def _capacity(r: Request) -> int:
    """Entries per head a request can ever hold: prompt + generated, bounded by max(prompt, K + 2r)."""
    total = len(r.prompt_ids) + max(r.max_new_tokens, len(r.forced or ()))
    return min(total, max(len(r.prompt_ids), r.spec.budget + 2 * r.spec.buffer)) if r.spec.compressed else total


class ReferenceEngine:
    """Load a Hugging Face causal LM with the eviction attention and generate under per-sequence specs.

        eng = ReferenceEngine(model_dir)
        outs = eng.generate([Request(ids, EvictSpec("random", budget=256, buffer=16, seed=0), max_new_tokens=512)])
    """

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
        cache = BatchKVCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                             q_heads=self.num_q_heads, dtype=self.dtype, device=self.device,
                             track_attention=track_attention, query_window=query_window)
        return DecodeBatch(self.model, cache, audit=audit, keep_records=keep_records,
                           manual_attention=self.manual_attention)

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], *, audit_log: str | Path | None = None, keep_records: bool = True,
                 max_batch: int | None = None) -> list[Output]:
        """Decode every request (batched, `max_batch` at a time); outputs in request order."""
        requests = list(requests)
        for i, r in enumerate(requests):
            if not r.req_id:
                r.req_id = f"ref-{i}"
        if max_batch is None or max_batch <= 0:
            max_batch = len(requests) or 1
        # Batch requests of similar cache bound together (a full-attention row sizes its whole batch).
        order = sorted(range(len(requests)), key=lambda i: (_capacity(requests[i]), i))
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
        caps = [_capacity(r) for r in reqs]
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
            batch.seqs[b] = _Seq(r, r.spec, pol, len(r.prompt_ids), eg, sg, evict_key=seed_key(seed))
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
        return [Output(s.req.req_id, s.prompt_len, s.tokens, s.logprobs, s.argmax, s.finished, s.rounds, s.records)
                for s in batch.seqs]

    def _choose_rows(self, seqs: list[_Seq], logits: Tensor) -> None:
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
