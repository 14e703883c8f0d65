"""kvtier's patches on vLLM's V1 `Scheduler` (vllm.v1.core.sched.scheduler, in the engine-core process),
listed with why in patches.py `PATCHES`.

Each function takes vLLM's original and returns its replacement, which calls the original; the scheduler-
side eviction state (scheduler_side.SchedulerEviction) is kept on the scheduler as `_kvtier` (None without
additional_config.kvtier, and every replacement then only calls the original). Assumes, of vLLM 0.31:
`Scheduler.__init__(vllm_config, kv_cache_config, ...)` with one KV cache group; `schedule()` returns the
SchedulerOutput that reaches the worker; `update_from_output(scheduler_output, model_runner_output, ...)`;
`add_request(request)` stores it in `self.requests`; `_preempt_request(request, ...)` and
`_free_request(request, ...)` are the one path for preemption and for finished or aborted requests.
"""

from __future__ import annotations

import functools


def scheduler_init(orig):
    @functools.wraps(orig)
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        orig(self, vllm_config, kv_cache_config, *args, **kwargs)
        from .config import EngineEvictionConfig
        from .scheduler_side import SchedulerEviction
        from .support import check_supported

        cfg = EngineEvictionConfig.from_vllm(vllm_config)
        self._kvtier = None
        if cfg is not None:
            check_supported(vllm_config, kv_cache_config)
            group = kv_cache_config.kv_cache_groups[0]
            self._kvtier = SchedulerEviction(cfg, group.kv_cache_spec.block_size, kv_cache_config.num_blocks - 1)
            from . import compat

            self._kvtier.limits = compat.step_limits(vllm_config.scheduler_config)
            compat.attach_to_kv_cache_manager(self, self._kvtier)
    return __init__


def schedule(orig):
    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is None:
            return orig(self, *args, **kwargs)
        from .payload import PAYLOAD_ATTR

        ev.plan(self)
        out = orig(self, *args, **kwargs)
        setattr(out, PAYLOAD_ATTR, ev.payload(self, out))
        return out
    return schedule


def update_from_output(orig):
    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            from .payload import FAILURES_ATTR

            ev.on_worker_failures(self, getattr(model_runner_output, FAILURES_ATTR, None))
        outputs = orig(self, scheduler_output, model_runner_output, *args, **kwargs)
        if ev is not None:
            from . import final_budget

            final_budget.attach(outputs, ev.finished)   # requests that finished in this step free there
            ev.finished.clear()
        return outputs
    return update_from_output


def add_request(orig):
    @functools.wraps(orig)
    def add_request(self, request):
        orig(self, request)
        ev = getattr(self, "_kvtier", None)
        if ev is not None and request.request_id in self.requests:
            ev.on_add(self.requests[request.request_id])
    return add_request


def preempt_request(orig):
    @functools.wraps(orig)
    def _preempt(self, request, *args, **kwargs):
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            ev.on_preempt(request)
        return orig(self, request, *args, **kwargs)
    return _preempt


def free_request(orig):
    @functools.wraps(orig)
    def _free(self, request, *args, **kwargs):
        out = orig(self, request, *args, **kwargs)
        ev = getattr(self, "_kvtier", None)
        if ev is not None:
            ev.on_free(request.request_id)
        return out
    return _free
