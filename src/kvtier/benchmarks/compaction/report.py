"""The compaction benchmark's driver: each cell's timed arms (median of `repeats` steps after a checked
warm-up), the memory cap that skips cells, and the JSON report with its summary against the targets.

Timings are host wall time around a synchronised step (the worker blocks on it); the first step from
the pristine cache serves as warm-up and is the one checked for exactness; between steps the buffer is
re-armed untimed as `positions_at` does. Cells whose estimated peak memory exceeds the cap are listed
under `skipped`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Callable

import torch

from kvtier.benchmarks.compaction.cell import Cell
from kvtier.benchmarks.compaction.batched_step import batched_step
from kvtier.benchmarks.compaction.exactness import check_step
from kvtier.benchmarks.compaction.floor_step import FLOOR_INDEX_BYTES, floor_keep, floor_step
from kvtier.benchmarks.compaction.layouts import CompactionShapes, cache_bytes, cache_shape, layout_writer, pool_size
from kvtier.policies import make_policy

TARGETS = {"random_ratio_to_floor_max": 0.25, "h200_ms_per_request_at_2048_max": 0.5}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def measure_cell(cell: Cell, policies: list[str], repeats: int) -> dict:
    dev = cell.device
    out: dict = {}
    # floor
    cell.restore()
    pos = cell.rearm()
    before = [p.clone() for p in pos]
    keep, evicted = floor_keep(cell, pos)
    _timed(lambda: floor_step(cell, keep, pos), dev)
    floor_exact = check_step(cell, before, evicted, cell.state)
    times = []
    for _ in range(repeats):
        pos = cell.rearm()
        keep, _ev = floor_keep(cell, pos)
        times.append(_timed(lambda: floor_step(cell, keep, pos), dev)[0])
    floor = statistics.median(times)
    out["floor_ms_per_step"] = round(floor, 4)
    out["floor_exact"] = floor_exact
    out["policies"] = {}
    for name in policies:
        policy = make_policy(name)
        cell.restore()
        pos = cell.rearm()
        before = [p.clone() for p in pos]
        _ms, evicted = _timed(lambda: batched_step(cell, name, policy, pos), dev)     # warm-up, checked
        exact = check_step(cell, before, evicted, cell.state)
        times = []
        for _ in range(repeats):
            pos = cell.rearm()
            times.append(_timed(lambda: batched_step(cell, name, policy, pos), dev)[0])
        ms = statistics.median(times)
        out["policies"][name] = {"ms_per_step": round(ms, 4), "ms_per_request": round(ms / cell.n, 4),
                                 "ratio_to_floor": round(ms / floor, 4) if floor > 0 else None, "exact": exact}
        if name == "random" and dev.type == "cuda":
            out["policies"][name]["host_syncs"] = host_syncs(lambda: batched_step(cell, name, policy, cell.rearm()))
    return out


def host_syncs(step: Callable[[], object]) -> str | None:
    """None when one step runs under torch.cuda.set_sync_debug_mode("error") (no host synchronisation:
    async scheduling keeps its CPU/GPU overlap), else the error naming the synchronising call."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return None
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def cell_memory(requests: int, budget: int, s: CompactionShapes, dtype: torch.dtype, chunk: int, pristine: str,
                device: str = "cpu") -> dict:
    """Estimated peak bytes of a cell: the cache, its pristine copy (a clone, or one regenerated layer),
    apply_rounds' row indices (int64 per row: 2d/chunk rows per entry; per round and concatenated) and
    the floor's (in groups of at most FLOOR_INDEX_BYTES)."""
    cache = cache_bytes(requests, budget, s, dtype)
    runs = 2 * s.head_dim // chunk
    rounds = requests * s.layers * s.kv_heads * s.buffer * runs * 8 * 2 * 2
    per_req = s.layers * s.kv_heads * (budget + s.buffer) * runs * 8 * 2
    floor = 2 * min(requests * per_req, max(per_req, FLOOR_INDEX_BYTES[device]))
    pristine_b = cache if pristine == "clone" else cache // s.layers
    return {"cache": cache, "total": cache + pristine_b + max(rounds, floor)}


def run_compaction_bench(*, device: str = "cpu", requests: list[int] | None = None, budgets: list[int] | None = None,
                         shapes: CompactionShapes = CompactionShapes(), layouts: list[str] | None = None,
                         policies: list[str] | None = None, repeats: int | None = None, dtype: str = "bfloat16",
                         threads: int | None = 1, max_gb: float | None = None, seed: int = 0,
                         cpu_writer: str = "auto", pristine: str | None = None,
                         progress: Callable[[dict], None] | None = None) -> dict:
    """The JSON report. max_gb: skip cells whose estimated peak memory (cell_memory) is larger (default:
    cpu 10 GiB, i.e. caches up to ~4 GiB; cuda 75% of free device memory). progress(report) is called
    after each cell with the report so far."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    requests = requests or ([1, 64, 256] if dev.type == "cuda" else [1, 8])
    budgets = budgets or [1024, 2048]
    layouts = layouts or ["flash", "cpu"]
    policies = policies or ["random", "snapkv", "rkv"]
    repeats = repeats or (10 if dev.type == "cuda" else 3)
    pristine = pristine or ("regenerate" if dev.type == "cuda" else "clone")
    if max_gb is None:
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            max_gb = 0.75 * free / 2**30
        else:
            max_gb = 10.0
    report: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "shapes": {**asdict(shapes), "dtype": dtype, "repeats": repeats, "max_gb": round(max_gb, 2), "pristine": pristine},
        "layouts": {}, "cells": [], "targets": dict(TARGETS), "skipped": [],
    }
    for name in layouts:
        lw = layout_writer(name, shapes, dev, dt, cpu_writer=cpu_writer)
        nb = pool_size(3, name, shapes)
        _paged, rows = lw.probe(torch.empty(cache_shape(name, nb, shapes), dtype=dt, device=dev), nb, shapes)
        report["layouts"][name] = {"chunk": rows.chunk, "writer": lw.writer, **lw.info}
        for budget in budgets:
            for n in requests:
                mem = cell_memory(n, budget, shapes, dt, rows.chunk, pristine, dev.type)
                if mem["total"] > max_gb * 2**30:
                    report["skipped"].append({"layout": name, "budget": budget, "requests": n,
                                              "reason": f"estimated {mem['total'] / 2**30:.1f} GiB (cache "
                                                        f"{mem['cache'] / 2**30:.1f} GiB) > cap {max_gb:.1f} GiB"})
                    continue
                cell = Cell(lw, budget, n, shapes, device=dev, dtype=dt, seed=seed, pristine=pristine)
                res = measure_cell(cell, policies, repeats)
                report["cells"].append({"layout": name, "budget": budget, "requests": n,
                                        "cache_gib": round(mem["cache"] / 2**30, 4), **res})
                del cell
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if progress is not None:
                    report["summary"] = _summary(report, dev)
                    progress(report)
    report["summary"] = _summary(report, dev)
    return report


def _summary(report: dict, dev: torch.device) -> dict:
    """Exactness over every cell; random's worst ratio to the floor; random's ms per request at K=2048
    per layout and request count (the H200 target is judged at the largest request count run)."""
    cells = report["cells"]
    out: dict = {"all_exact": all(c["floor_exact"] and all(p["exact"] for p in c["policies"].values()) for c in cells)}
    rnd = [c for c in cells if "random" in c["policies"]]
    if rnd:
        out["random_ratio_to_floor_max"] = max(c["policies"]["random"]["ratio_to_floor"] for c in rnd)
        out["random_ratio_target_met"] = out["random_ratio_to_floor_max"] <= TARGETS["random_ratio_to_floor_max"]
        at2048: dict = {}
        for c in rnd:
            if c["budget"] == 2048:
                at2048.setdefault(c["layout"], {})[str(c["requests"])] = c["policies"]["random"]["ms_per_request"]
        if at2048:
            out["random_ms_per_request_at_2048"] = at2048
            if dev.type == "cuda":
                top = max(c["requests"] for c in rnd)
                worst = max(c["policies"]["random"]["ms_per_request"] for c in rnd
                            if c["budget"] == 2048 and c["requests"] == top)
                out["h200_ms_per_request_target_met"] = worst <= TARGETS["h200_ms_per_request_at_2048_max"]
    return out
