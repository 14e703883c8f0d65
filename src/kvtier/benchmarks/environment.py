"""What a committed benchmark result records about where it ran: the machine and the commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _isa() -> list[str]:
    """The CPU features vLLM's CPU attention picks its layout from."""
    from kvtier.engine.cpu_dtype import cpu_flags

    have = cpu_flags()
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]


def machine_and_commit() -> dict:
    """{"machine": {cpu, cores, isa, python, torch, vllm}, "commit": sha (+ "-dirty")}."""
    versions = {}
    for mod in ("torch", "vllm", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        commit = sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "isa": _isa(),
                        "python": platform.python_version(), **versions}, "commit": commit}


def speed_probe_ms(repeats: int = 5) -> float:
    """How fast this machine runs right now: the median of `repeats` timings of a fixed float32 matmul
    workload on one thread, in ms. Benchmarks record it around each arm, so a machine whose speed drifted
    while arms ran one after another (a VM's neighbours) shows in the JSON instead of in the ratios."""
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(192, 192)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(40):
                a = torch.tanh(a @ a * 1e-3)
            times.append((time.perf_counter() - t0) * 1000)
        return round(statistics.median(times), 2)
    finally:
        torch.set_num_threads(threads)
