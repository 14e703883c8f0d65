"""H2O: heavy hitters by the attention a position has accumulated since it entered the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import ATTENTION, EvictionContext, EvictionPolicy
from .registry import register

# Largest [H_q, queries, keys] logit block built at once by `accumulated_attention` (fp32 elements).
_BLOCK_ELEMENTS = 1 << 24


@register
@dataclass(kw_only=True, eq=False, repr=False)
class H2OPolicy(EvictionPolicy):
    """s_i = Σ_{t'=i}^{t} α_i^(t') (Zhang et al., 2023; paper §2).

    The engine keeps the running sum per (layer, KV head, cache slot) and hands it over as `attention`
    [H, S]: every query adds its softmax attention on each cached entry it can see (averaged over the
    KV head's query group), and the sum moves with its entry when the cache is compacted (the same
    hole-filling src -> dst plan as the keys). Evicted entries take their sums with them; a new entry
    starts at 0 and gets the attention of its own step and every later one. The recent buffer plays the
    role of H2O's local window.

    How the engine gets α (vLLM's fused attention kernels do not expose their weights): it recomputes
    them with `accumulated_attention`, in fp32, from exactly the bf16 queries and cached keys the kernel
    used and with its softmax scale, so the sums are exact up to the kernel's bf16 arithmetic vs this
    fp32 recomputation (tests/test_engine_policies.py: within 0.3% of the largest sum of an fp32
    transformers model replaying the same keep-sets, a margin that includes the bf16-vs-fp32 model).
    Queries are captured per request in a ring of w = max(query_window, r) entries and added in
    batches: at each round, before selection, every query since the previous batch; earlier whenever
    the ring would overwrite a query not yet added (a prefill chunk longer than w is added in the step
    that computes it, against the cached keys plus the chunk's own keys). Query t sees the entries held
    at its step, causally by logical position; nothing is evicted between two batches, so that is what
    the kernel saw. Two definitional choices, not approximations: the group average (H2O is per
    attention head; kvtier evicts per KV head) and the prompt's own queries count (H2O accumulates from
    the prefill on). Cost: the ring (layers x H_q x w x d in the model dtype per request), the sums
    (layers x H x (K + 2r) fp32), and per round one fp32 attention of r queries over K + 2r keys per layer.
    """

    name = "h2o"
    needs = frozenset({ATTENTION})
    default_protect_prompt = False
    default_sinks = 4

    def score(self, ctx: EvictionContext) -> Tensor:
        return ctx.attention


def accumulated_attention(keys: Tensor, key_positions: Tensor, queries: Tensor, query_positions: Tensor,
                          scale: float | None = None) -> Tensor:
    """[H, n] float32: Σ_t mean_{g in group} softmax_j(q_{g,t}·k_j · scale) over the keys j with
    key_positions[h, j] <= query_positions[t] (causal by logical position), for every key.

    keys [H, n, d] in any per-head slot order; key_positions [H, n]; queries [H_q, m, d] with query head
    j in KV head j // (H_q / H); query_positions [m]. scale defaults to 1/sqrt(d). A query that sees
    no key adds nothing. Computed in fp32, in blocks of queries (bounded memory for long prefills).
    """
    H, n, d = keys.shape
    Hq, m, _ = queries.shape
    out = torch.zeros(H, n, dtype=torch.float32, device=keys.device)
    if n == 0 or m == 0:
        return out
    group = Hq // H
    scale = d ** -0.5 if scale is None else float(scale)
    k = keys.float()
    kpos = key_positions.to(keys.device).view(H, 1, 1, n)
    qpos = query_positions.to(keys.device)
    q_all = queries.float().view(H, group, m, d)
    step = max(1, _BLOCK_ELEMENTS // max(Hq * n, 1))
    for s in range(0, m, step):
        q = q_all[:, :, s : s + step]                                  # [H, G, c, d]
        logits = torch.einsum("hgcd,hnd->hgcn", q, k) * scale
        visible = kpos <= qpos[s : s + step].view(1, 1, -1, 1)         # [H, 1, c, n]
        logits = logits.masked_fill(~visible, float("-inf"))
        w = torch.softmax(logits, dim=-1).nan_to_num_(0.0)             # rows with nothing visible -> 0
        out += w.sum(dim=2).mean(dim=1)
    return out
