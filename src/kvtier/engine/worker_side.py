"""Worker-process half of the compressed engine: per-KV-head compaction on vLLM's paged cache.

At the start of each step (before vLLM zeroes or appends blocks, since the scheduler may already have
handed a freed tail block to another request) every compaction due this step runs together:
1. selection (`victim_selection.py`): one call per policy group for all (request, layer, KV head) rows
   due (for `random`: one counter-based draw, `kvtier.policies.keyed_random`); policies that read keys,
   values, queries or accumulated attention get them gathered for their due requests only;
2. copies: survivors from the tail move into the holes (hole filling, at most r entries per head), one
   row-granular index copy per layer for every round of the step (`paged_compaction`);
3. the request's block list and block-table row are cut to the blocks it still needs.
After vLLM prepares inputs, slot mapping and sequence lengths are rewritten to physical positions while
RoPE positions stay logical. Every tensor built here lives on the cache's device.

A policy that raises for a request does not stop the engine: that request is compacted with `random`
(the scheduler has already freed its tail blocks, so the copy must happen) and reported on the step's
output, where the scheduler finishes it with an error.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import Tensor

from kvtier.policies.base import ATTENTION, QUERIES
from kvtier.policies.keyed_random import seed_key

from . import compat
from .config import EngineEvictionConfig, EvictionSpec, resolve_request_spec
from .layout import PagedLayout, probe_layout
from .paged_compaction import Round, RowLayout, apply_rounds, to_device
from .payload import PAYLOAD_ATTR, CompactionOp, StepPayload
from .query_capture import QueryCapture, WorkerRequest
from .stats import AuditLog, EvictionStats, budget_label
from .victim_selection import DeferredDrawCheck, keyed_draw, select_keyed, select_one

logger = logging.getLogger("kvtier.engine")


def query_window(cfg: EngineEvictionConfig, spec: EvictionSpec) -> int:
    """Ring size for a request: the engine's query_window, the policy's own `window`, and for policies
    reading accumulated attention at least r (the queries between two rounds)."""
    policy = spec.make_policy()
    w = max(cfg.query_window, int(getattr(policy, "window", 0) or 0))
    if ATTENTION in policy.needs:
        w = max(w, spec.buffer)
    return w


class WorkerEviction:
    def __init__(self, runner, cfg: EngineEvictionConfig) -> None:
        self.runner = runner
        self.cfg = cfg
        layers = compat.attention_layers(runner)
        self.layer_names = list(layers)
        self.layers = list(layers.values())
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        spec = compat.kv_cache_group(runner).kv_cache_spec
        self.block_size, self.num_kv_heads, self.head_dim = spec.block_size, spec.num_kv_heads, spec.head_size
        self.num_q_heads = runner.model_config.get_num_attention_heads(runner.parallel_config)
        # The softmax scale each attention layer's kernel uses (H2O recomputes the kernel's weights).
        scales = [float(getattr(layer.impl, "scale", self.head_dim ** -0.5)) for layer in self.layers]
        caches = [compat.layer_cache(layer) for layer in self.layers]
        self.device, self.dtype = caches[0].device, caches[0].dtype
        # Tensor parallelism: this rank holds KV heads [rank * H, (rank + 1) * H) of the model.
        self.tp_rank, self.tp_size = compat.tensor_parallel(runner)
        # The device tables below are rebuilt from host copies on every wake-up (`on_wake`): vLLM's sleep
        # mode discards its "kv_cache" memory pool, and nothing kvtier needs may depend on which pool a
        # tensor happened to be allocated in.
        self._host_tables: dict[str, Tensor] = {}
        self._cache_geometry = None
        self._build_tables(caches, probe=True)
        self.capture = QueryCapture(self.rows, self.row_views, scales, self.device)
        self.requests: dict[str, WorkerRequest] = {}
        self.failures: dict[str, str] = {}
        self._compacted_this_step = False
        self.draw_check = DeferredDrawCheck()
        self.stats = EvictionStats()
        path = cfg.audit_log
        if path and self.tp_size > 1:
            path = f"{path}.rank{self.tp_rank}"
        self.audit = AuditLog(path) if path else None
        # patch_worker.install_attention_capture wraps every layer's attention to feed self.capture

    # -- device tables (layout, rows, heads) and sleep/wake ------------------------------------
    @staticmethod
    def _geometry(cache: Tensor) -> tuple:
        return tuple(cache.shape), tuple(cache.stride()), cache.dtype, cache.device

    def _build_tables(self, caches: list[Tensor], probe: bool) -> None:
        """Set the device tables compaction reads: the probed paged layout (K/V element offsets), its row
        layout, the global KV-head index of each local head, and one row view per layer cache. `probe`:
        probe the backend's layout (start-up, or a cache whose geometry changed); otherwise the tables are
        copied from the host copies made at the first probe."""
        geometry = self._geometry(caches[0])
        if probe or geometry != self._cache_geometry:
            layout = probe_layout(
                caches[0], self.runner.kv_cache_config.num_blocks, self.num_kv_heads, self.block_size,
                self.head_dim, lambda k, v, cache, slots: compat.write_kv(self.layers[0], k, v, cache, slots))
            rows = RowLayout.from_layout(layout, self.device)
            heads = torch.arange(self.num_kv_heads) + self.tp_rank * self.num_kv_heads
            # host copies (clone: on a CPU engine .to("cpu") would alias the device tensors)
            self._host_tables = {"k_offsets": layout.k_offsets.to("cpu").clone(),
                                 "v_offsets": layout.v_offsets.to("cpu").clone(),
                                 "rows": rows.rows.to("cpu").clone(), "global_heads": heads.clone()}
            self._cache_geometry = geometry
            self._layout_meta = (layout.block_dim, layout.block_stride, rows.chunk, rows.block_rows)
        host = self._host_tables
        block_dim, block_stride, chunk, block_rows = self._layout_meta
        self.layout = PagedLayout(self.block_size, self.num_kv_heads, self.head_dim, block_dim, block_stride,
                                  host["k_offsets"].to(self.device, copy=True),
                                  host["v_offsets"].to(self.device, copy=True))
        self.rows = RowLayout(self.block_size, self.num_kv_heads, self.head_dim, chunk, block_rows,
                              host["rows"].to(self.device, copy=True))
        self.global_heads = host["global_heads"].to(self.device, copy=True)
        self.row_views = [self.rows.view(self.layout.flat(c)) for c in caches]

    def on_wake(self, tags: list[str] | None) -> None:
        """After vLLM's `Worker.wake_up(tags)` (the wake_up patches in patches.py): the KV cache pool was discarded
        and re-mapped, its contents are gone. Rebuild every device table from the host copies and the row
        views from the caches as bound now, and forget per-request device state: vLLM preempted (sleep
        mode "keep") or aborted (mode "abort") every request before sleeping, so each one is recomputed
        from scratch (the scheduler's reset) or finished."""
        if tags is not None and "kv_cache" not in tags:
            return
        caches = [compat.layer_cache(layer) for layer in self.layers]
        self._build_tables(caches, probe=False)
        self.capture.layout, self.capture.row_views, self.capture.rows = self.rows, self.row_views, []
        for st in self.requests.values():
            st.reset()
        self.stats.engine.wakeups += 1
        logger.info("kvtier: device tables rebuilt after wake-up (tags=%s)", tags)

    # -- request state ------------------------------------------------------------------------
    def _state(self, req_id: str, seed: int | None) -> WorkerRequest:
        st = self.requests.get(req_id)
        if st is None:
            # OS entropy unless the request set kvtier_seed; never the global torch generators, which
            # vLLM's seeded sampling relies on.
            key = seed_key(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
            gen = torch.Generator(device=self.device)
            gen.manual_seed(key * 65521 + self.tp_rank)
            st = self.requests[req_id] = WorkerRequest(key, gen)
        return st

    def forget(self, req_ids) -> None:
        """Finished (or aborted) requests: drop their worker state; their counters stay readable for a
        while (EvictionStats keeps finished requests, bounded)."""
        for rid in req_ids:
            self.requests.pop(rid, None)
        self.stats.finish(req_ids)

    def take_failures(self) -> dict[str, str] | None:
        """Requests whose policy failed this step on any tensor-parallel rank (req_id -> error), for the
        step's output. vLLM returns only the output rank's ModelRunnerOutput, so under TP the ranks gather
        their failures on every step that ran compaction (the only steps where a policy can fail; every rank
        knows which steps those are, the scheduler output is the same): one small gloo all-gather then."""
        if self.tp_size > 1 and self._compacted_this_step:
            merged: dict[str, str] = {}
            for rank, part in enumerate(compat.tp_all_gather_object(self.failures)):
                merged.update({rid: f"tp rank {rank}: {err}" for rid, err in (part or {}).items()})
            self.failures = merged
        self._compacted_this_step = False
        if not self.failures:
            return None
        out, self.failures = self.failures, {}
        return out

    # -- step hooks ---------------------------------------------------------------------------
    def before_update_states(self, scheduler_output) -> None:
        payload: StepPayload | None = getattr(scheduler_output, PAYLOAD_ATTR, None)
        if payload is None:
            return
        for rid, row in payload.resets.items():
            st = self.requests.get(rid)
            if st is not None:
                st.reset()
            rc = self.stats.request(rid)
            rc.preemptions += 1
            rc.resets.append([int(row), rc.events])
            if self.audit is not None:
                self.audit.write(req_id=rid, reset_row=row)
        self.stats.engine.blocks_freed += payload.blocks_freed
        self.stats.engine.preemptions_compressed += payload.preempted_compressed
        eng = self.stats.engine
        for why, n in payload.tightenings.items():
            eng.tightenings[why] = eng.tightenings.get(why, 0) + n
        eng.elastic_at_floor, eng.elastic_requests = payload.elastic
        self._compacted_this_step = bool(payload.ops)
        for rid in self.draw_check.failed(self.requests):
            self.failures[rid] = "random's keyed draw came out short (fewer than K distinct victims)"
        if payload.ops:
            t0 = time.perf_counter()
            self._compact(payload.ops)
            self.draw_check.copy()
            self.stats.observe_round_ms((time.perf_counter() - t0) * 1e3)
            self.stats.engine.steps_with_eviction += 1

    def after_update_states(self, scheduler_output) -> None:
        self.forget(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            self._on_new_request(new.req_id, new.sampling_params)
        for rid in scheduler_output.num_scheduled_tokens:
            if rid in self.requests:
                ids = compat.request_block_ids(self.runner, rid)
                rc = self.stats.request(rid)
                rc.peak_blocks = max(rc.peak_blocks, len(ids or ()))

    def after_prepare_inputs(self, scheduler_output, num_reqs: int) -> None:
        """Plan this step's query capture, then rewrite slot mapping and seq_lens to physical positions."""
        runner = self.runner
        req_ids = compat.batch_req_ids(runner, num_reqs)
        qsl = compat.query_start_loc(runner, num_reqs).tolist()
        payload: StepPayload | None = getattr(scheduler_output, PAYLOAD_ATTR, None)
        offsets_of = payload.offsets if payload is not None else {}
        computed = compat.num_computed_tokens(runner, num_reqs)
        todo = [(rid, self.requests[rid], qsl[i], qsl[i + 1], int(computed[i])) for i, rid in enumerate(req_ids)
                if rid in self.requests and self.requests[rid].queries is not None and qsl[i + 1] > qsl[i]]
        self.capture.plan(todo, lambda rid: compat.request_block_ids(runner, rid), offsets_of)
        if not offsets_of:
            return
        host = torch.tensor([offsets_of.get(r, 0) for r in req_ids], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        compat.to_physical(runner, num_reqs, host.to(self.device, non_blocking=True), host)

    def _on_new_request(self, req_id: str, sampling_params) -> None:
        if sampling_params is None:
            return
        spec = resolve_request_spec(self.cfg.default, sampling_params.extra_args)
        if not spec.compressed:
            return
        st = self._state(req_id, spec.seed)
        needs = spec.make_policy().needs
        if needs & {QUERIES, ATTENTION} and st.queries is None:
            w = query_window(self.cfg, spec)
            st.queries = torch.zeros(len(self.layers), self.num_q_heads, w, self.head_dim, dtype=self.dtype,
                                     device=self.device)
            st.query_pos = torch.full((w,), -1, dtype=torch.long)
        if ATTENTION in needs and st.attention is None:
            st.ensure_attention(len(self.layers), self.num_kv_heads, 0, self.device)

    # -- selection ----------------------------------------------------------------------------
    def _select_keyed(self, items) -> list[Tensor]:
        """`random` for many rounds at once (victim_selection.select_keyed); rounds whose draw came out
        short (astronomically rare) are read a step later (victim_selection.DeferredDrawCheck)."""
        return select_keyed(items, len(self.layers), self.global_heads, self.device, self.draw_check.flags)

    def _select_one(self, op: CompactionOp, st: WorkerRequest, pos: Tensor, blocks: Tensor) -> Tensor:
        """Evicted slots [layers, H, e], ascending per head, for one round of a policy without a keyed draw
        (victim_selection.select_one)."""
        return select_one(op, st, pos, blocks, rows=self.rows, row_views=self.row_views, num_layers=len(self.layers),
                          num_kv_heads=self.num_kv_heads, global_heads=self.global_heads, device=self.device)

    def _select(self, items) -> list[Tensor]:
        keyed = [i for i, (op, *_rest) in enumerate(items) if keyed_draw(op.spec.make_policy())]
        out: list[Tensor | None] = [None] * len(items)
        for i, ev in zip(keyed, self._select_keyed([items[i] for i in keyed])):
            out[i] = ev
        for i, item in enumerate(items):
            if out[i] is not None:
                continue
            op = item[0]
            try:
                out[i] = self._select_one(*item)
                e = op.old_len - op.new_len
                if out[i].shape != (len(self.layers), self.num_kv_heads, e):
                    raise RuntimeError(f"policy returned {tuple(out[i].shape)} victims, expected {e} per head")
            except Exception as exc:   # noqa: BLE001 - a policy bug must cost one request, not the engine
                logger.error("kvtier: policy %r failed for request %s (%s: %s); the request is aborted",
                             op.spec.policy, op.req_id, type(exc).__name__, exc)
                self.failures[op.req_id] = f"{type(exc).__name__}: {exc}"
                self.stats.engine.policy_failures += 1
                out[i] = self._select_keyed([item])[0]   # the freed blocks are gone: compact anyway
        return out

    # -- compaction ---------------------------------------------------------------------------
    def _compact(self, ops: list[CompactionOp]) -> None:
        L, H, bs = len(self.layers), self.num_kv_heads, self.block_size
        items = []
        for op in ops:
            block_ids = compat.request_block_ids(self.runner, op.req_id)
            if block_ids is None:
                continue
            blocks = to_device(block_ids[: -(-op.old_len // bs)], self.device)
            st = self._state(op.req_id, op.spec.seed)
            pos = st.positions_at(op.old_len, op.query_position, L, H, self.device)
            if st.attention is not None:
                self.capture.add_attention_round(st, pos, blocks, op.old_len)
            items.append((op, st, pos, blocks))
        evicted = self._select(items)
        moves = apply_rounds(self.rows, self.row_views, [Round(blocks, ev, op.old_len)
                                                          for (op, _, _, blocks), ev in zip(items, evicted)])
        for (op, st, pos, _blocks), (src, dst) in zip(items, moves):
            # slot map (and H2O's accumulated attention): survivors from the tail take the holes
            pos.scatter_(2, dst, pos.gather(2, src))
            st.positions, st.length = pos[:, :, : op.new_len].contiguous(), op.new_len
            st.rounds = op.round
            if st.attention is not None:
                acc = st.attention[:, :, : op.old_len]
                acc.scatter_(2, dst, acc.gather(2, src))
                st.attention[:, :, op.new_len :] = 0                         # freed slots start at 0
            compat.truncate_request_blocks(self.runner, op.req_id, op.keep_blocks)
            self.stats.record_round(op.req_id, op.spec.policy_name, op.old_len - op.new_len,
                                    budget_label(op.spec.budget, op.spec.floor))
            if op.spec.elastic and op.round == 1:      # the tightening round of an elastic request
                self.stats.engine.tokens_evicted_under_pressure += op.old_len - op.new_len
            if self.audit is not None:
                kept = st.positions.sort(dim=2).values[:, :, : op.new_len - op.spec.buffer]
                self.audit.write(req_id=op.req_id, round=op.round, query_position=op.query_position,
                                 prompt_len=op.prompt_len,
                                 protected=op.spec.make_policy().protected_len(op.prompt_len),
                                 budget=op.spec.budget, buffer=op.spec.buffer,
                                 policy=op.spec.policy, kept=kept.tolist(),
                                 **({"heads": self.global_heads.tolist()} if self.tp_size > 1 else {}))
