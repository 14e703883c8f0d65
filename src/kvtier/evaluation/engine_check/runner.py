"""Build the engine a target describes, in this process, and run the checks on it.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the checks read the scheduler's
pool (`kvtier.engine.api.pool_state`), and the tests plant faults in it. Workers are vLLM's own (one in
process, or one process per rank under tensor parallelism), as when serving.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from .checks import (TOLERANCE, CheckRun, EngineUnderCheck, check_blocks, check_eviction, check_oracle,
                     check_preemption, check_prefix_cache)
from .results import CheckResult, Report
from .target import CheckTarget

logger = logging.getLogger("kvtier.engine_check")

CHECKS: dict[str, Callable[[CheckRun], CheckResult]] = {
    "eviction": check_eviction, "oracle": check_oracle, "blocks": check_blocks,
    "preemption": check_preemption, "prefix_cache": check_prefix_cache,
}
ALL = ["allowlist", *CHECKS]


def in_process_engine_core() -> None:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        logger.warning("kvtier engine check: VLLM_ENABLE_V1_MULTIPROCESSING=0 for the check (it reads the "
                       "scheduler's KV pool in this process)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def describe(config) -> dict:
    """The settings that choose the engine's code paths, as vLLM resolved them."""
    from vllm.platforms import current_platform

    comp = config.compilation_config
    return {
        "device": current_platform.device_name if hasattr(current_platform, "device_name") else str(current_platform.device_type),
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "async_scheduling": bool(getattr(config.scheduler_config, "async_scheduling", False)),
        "block_size": config.cache_config.block_size,
    }


def check_allowlist(target: CheckTarget):
    """(result, vLLM's resolved config or None): the configuration on kvtier's tested table."""
    from vllm.engine.arg_utils import EngineArgs

    from kvtier.engine.plugin import register
    from kvtier.engine.support import UnsupportedEngineConfig

    register()
    try:
        config = EngineArgs(model=target.model, **target.engine_kwargs).create_engine_config()
    except UnsupportedEngineConfig as exc:
        return CheckResult("allowlist", "FAIL", str(exc)), None
    return CheckResult("allowlist", "PASS", "on kvtier's tested table (`kvtier engine supported`)"), config


def open_engine(target: CheckTarget, audit_path: str, *, reference_device: str = "cpu",
                tolerance: float | None = None) -> EngineUnderCheck:
    """The target's engine with its keep-sets logged to `audit_path` (UnsupportedEngineConfig if refused)."""
    in_process_engine_core()
    from vllm import LLM

    from kvtier.engine.api import warm_up
    from kvtier.engine.plugin import register

    register()
    kwargs = dict(target.engine_kwargs)
    extra = dict(kwargs.pop("additional_config", None) or {})
    extra["kvtier"] = {**(extra.get("kvtier") or {}), "audit_log": audit_path}
    llm = LLM(model=target.model, additional_config=extra, **kwargs)
    warm_up(llm)
    config = llm.llm_engine.vllm_config
    dtype = str(config.model_config.dtype).removeprefix("torch.")
    replay = []

    def reference():
        if not replay:
            import torch

            from kvtier.reference import MaskedReplay

            replay.append(MaskedReplay(target.model, dtype=torch.float32, device=reference_device))
        return replay[0]

    return EngineUnderCheck(llm, reference, audit_path, tolerance or TOLERANCE.get(dtype, 0.06),
                            config.parallel_config.tensor_parallel_size, bool(config.cache_config.enable_prefix_caching),
                            config.model_config.get_vocab_size())


def run_checks(engine: EngineUnderCheck, only: list[str] | None = None, seed: int | None = None) -> list[CheckResult]:
    """The checks named in `only` (all by default) on an open engine; a check that raises is a FAIL."""
    # vLLM seeds Python's global `random` in-process: fresh prompts need another source
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    run, out = CheckRun(engine, seed), []
    for name, fn in CHECKS.items():
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result = fn(run)
        except Exception as exc:  # noqa: BLE001 - a check that crashes has failed, by name
            logger.exception("kvtier engine check: %s raised", name)
            result = CheckResult(name, "FAIL", f"raised {type(exc).__name__}: {exc}")
        result.details["seconds"] = round(time.perf_counter() - t0, 2)
        result.details.setdefault("seed", seed)
        out.append(result)
    return out


def run_engine_check(target: CheckTarget, *, only: list[str] | None = None, reference_device: str = "cpu",
                     tolerance: float | None = None, seed: int | None = None, workdir: str | None = None) -> Report:
    """Every check on the target's engine, built in this process; the report says PASS/FAIL/SKIP for each."""
    in_process_engine_core()
    t0 = time.perf_counter()
    allow, config = check_allowlist(target)
    configuration = describe(config) if config is not None else {}
    results = [allow]
    names = [n for n in CHECKS if only is None or n in only]
    if config is None:
        results += [CheckResult(n, "SKIP", "the engine was refused (allowlist)") for n in names]
        return Report(target.label, configuration, results, time.perf_counter() - t0)
    tmp = tempfile.mkdtemp(prefix="kvtier-engine-check-", dir=workdir)
    try:
        engine = open_engine(target, str(Path(tmp) / "keep.jsonl"), reference_device=reference_device,
                             tolerance=tolerance)
    except Exception as exc:  # noqa: BLE001 - e.g. the worker's backend checks (UnsupportedEngineConfig)
        results[0] = CheckResult("allowlist", "FAIL", f"the engine did not start: {type(exc).__name__}: {exc}")
        results += [CheckResult(n, "SKIP", "the engine did not start") for n in names]
        return Report(target.label, configuration, results, time.perf_counter() - t0)
    results[0].figure += f"; engine started, tolerance {engine.tolerance} for {configuration.get('dtype')}"
    results += run_checks(engine, names, seed)
    return Report(target.label, configuration, results, time.perf_counter() - t0)
