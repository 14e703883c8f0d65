"""Victim selection for the compressed engine's worker: which (layer, KV head) slots each due round evicts.

`random` (plain, not its subclasses with their own scores) draws every round of a step at once from
counter-based keys (`kvtier.policies.keyed_random`): keyed by (request seed, round, layer, global KV
head), so a row's draw does not depend on the batch. Any other policy is called per round, with what it
reads gathered for that request only: candidates' keys/values (and the buffer's keys) from the paged
cache, the ring of recent queries, accumulated attention, and the request's `WorkerRequest.extras` as
ctx.extras["state"] (a policy's own state across rounds, e.g. random_line_reserve's anchors). The worker
(`worker_side.WorkerEviction`) calls these with its device tables and handles a policy that fails.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtier.policies import EvictionContext
from kvtier.policies.base import ATTENTION, BUFFER_KEYS, KEYS, QUERIES, VALUES
from kvtier.policies.keyed_random import keyed_victims
from kvtier.policies.random import RandomPolicy

from .paged_compaction import RowLayout, gather_rows, to_device
from .payload import CompactionOp
from .query_capture import WorkerRequest

# Policies whose scores depend on the layer (ctx.extras["layer"]) are called per layer; the rest get
# every layer of a request stacked as rows (GQA grouping stays aligned: row l*H + h <-> queries l*H_q + ...).
PER_LAYER_POLICIES = frozenset({"triattention", "diverse"})


def keyed_draw(policy) -> bool:
    """Plain `random` (not its subclasses with their own scores) draws victims from counter-based keys."""
    return type(policy) is RandomPolicy


# None: read `random`'s rare-fallback flag on the host only where that is free (a CPU cache); on a GPU the
# flags are read after the step (WorkerEviction). Tests set False to run the GPU path on CPU.
HOST_CHECK: bool | None = None


class DeferredDrawCheck:
    """`random`'s short-draw flags of one step, read on the host a step later: a GPU step must not wait
    for the forward in flight, and a short draw (fewer than K distinct victims, astronomically rare)
    cannot be repaired after its copies ran anyway; its request is then ended with an error."""

    def __init__(self) -> None:
        self.flags: list = []               # this step's (req_ids, [n] bool device tensor), from select_keyed
        self._pending = None                # the previous step's (ids, host flags, event)

    def copy(self) -> None:
        """After the step's compaction: start copying the flags to (pinned) host memory."""
        if not self.flags:
            return
        ids = [rid for rids, _ in self.flags for rid in rids]
        flags = torch.cat([f for _, f in self.flags])
        host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=flags.device.type == "cuda")
        host.copy_(flags, non_blocking=True)
        event = None
        if flags.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending, self.flags = (ids, host, event), []

    def failed(self, live) -> list[str]:
        """Request ids (among `live`) whose draw of the previous compacting step was short."""
        if self._pending is None:
            return []
        ids, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()             # recorded a step ago: long complete
        return [rid for rid, short in zip(ids, host.tolist()) if short and rid in live]


def select_keyed(items, num_layers: int, global_heads: Tensor, device: torch.device,
                 short_out: list | None = None) -> list[Tensor]:
    """`random` for many rounds at once: one counter-based draw over every (round, layer, head) row.
    Rows are grouped by (candidates, victims); keys make each row's draw independent of the batch.
    short_out (no host check): gets (req_ids, [len] bool device tensor) of rounds whose draw was short."""
    L = num_layers
    out: dict[int, Tensor] = {}
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (op, st, _pos, _blocks) in enumerate(items):
        sched = op.spec.schedule()
        groups.setdefault((sched.num_candidates(op.old_len), op.old_len - op.new_len), []).append(i)
    for (n_cand, e), idx in groups.items():
        ops = [items[i] for i in idx]
        shorts: list[Tensor] = []
        victims = keyed_victims(
            to_device([st.key for _, st, _, _ in ops], device), to_device([op.round for op, _, _, _ in ops], device),
            L, global_heads, to_device([op.spec.make_policy().protected_len(op.prompt_len) for op, _, _, _ in ops],
                                       device), n_cand, e, host_check=HOST_CHECK, short_out=shorts)
        if shorts and short_out is not None:
            short_out.append(([op.req_id for op, _, _, _ in ops], shorts[0].view(len(ops), -1).any(dim=1)))
        for j, i in enumerate(idx):
            out[i] = victims[j]
    return [out[i] for i in range(len(items))]


def select_one(op: CompactionOp, st: WorkerRequest, pos: Tensor, blocks: Tensor, *, rows: RowLayout,
               row_views: list[Tensor], num_layers: int, num_kv_heads: int, global_heads: Tensor,
               device: torch.device) -> Tensor:
    """Evicted slots [layers, H, e], ascending per head, for one round of a policy without a keyed draw."""
    policy, sched = op.spec.make_policy(), op.spec.schedule()
    L, H = num_layers, num_kv_heads
    n_cand = sched.num_candidates(op.old_len)
    cand = pos[:, :, :n_cand]
    base = dict(budget=sched.budget, prompt_len=op.prompt_len, generator=st.generator,
                query_position=op.query_position)
    if policy.order_free and not policy.needs:   # one call for every layer and head
        ev = policy.evict(EvictionContext(positions=cand.reshape(L * H, n_cand), **base))
        return ev.view(L, H, -1)
    needs = policy.needs | (getattr(policy, "optional", frozenset()) & {BUFFER_KEYS})
    order = cand.argsort(dim=2)                               # chronological candidate order per head
    buffer_slots = torch.arange(n_cand, op.old_len, device=device).expand(H, op.old_len - n_cand)
    got: dict = {}
    if needs & {KEYS, VALUES, BUFFER_KEYS}:
        with_buffer = BUFFER_KEYS in needs
        kv = [gather_rows(rows, row_views[li], blocks,
                          torch.cat([order[li], buffer_slots], 1) if with_buffer else order[li]) for li in range(L)]
        k, v = torch.stack([x[0] for x in kv]), torch.stack([x[1] for x in kv])     # [L, H, n, d]
        got[KEYS], got[VALUES] = k[:, :, :n_cand], v[:, :, :n_cand]
        if with_buffer:
            got[BUFFER_KEYS] = k[:, :, n_cand:]
    if QUERIES in needs and st.queries is not None:
        got[QUERIES] = st.recent_queries()                                            # [L, H_q, w, d]
    if ATTENTION in needs:
        acc = st.attention[:, :, :n_cand] if st.attention is not None else torch.zeros(L, H, n_cand, device=device)
        got[ATTENTION] = acc.gather(2, order)
    got = {k: v for k, v in got.items() if k in needs}
    chrono = cand.gather(2, order)
    if op.spec.policy in PER_LAYER_POLICIES:
        extras = {"num_layers": L, "kv_heads": global_heads, "state": st.extras}
        picks = [policy.evict(EvictionContext(positions=chrono[li], extras={**extras, "layer": li},
                                              **{k: v[li] for k, v in got.items()}, **base)) for li in range(L)]
        ev = torch.stack(picks)
    else:
        stacked = {k: v.reshape(L * v.shape[1], *v.shape[2:]) for k, v in got.items()}
        ev = policy.evict(EvictionContext(positions=chrono.reshape(L * H, n_cand),
                                          extras={"num_layers": L, "state": st.extras},
                                          **stacked, **base)).view(L, H, -1)
    return order.gather(2, ev).sort(dim=2).values
