"""Whether this CPU computes bfloat16 natively, and the start-up line when an engine would run it without.

vLLM 0.31's CPU linear layers use a oneDNN matmul; oneDNN builds a bf16 one only with AVX512-BF16 or AMX.
Without (an AVX2 machine), `dispatch_cpu_unquantized_gemm` logs one debug-level warning and falls back to
torch's linear, whose bf16 GEMM there is a reference loop: 1.1 GFLOP/s against 78 for float32 on the same
core (2048x512 @ 512x1024, one thread, AMD EPYC with AVX2, torch 2.13). Outputs stay correct, so the engine
does not refuse; `kvtier serve` says so once per engine, with the fix.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The `flags` of /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def bf16_slow_path_note(dtype: str | None, accelerator: str, flags: set[str] | None = None) -> str | None:
    """One line for an engine given `dtype` (None: kvtier's default, bfloat16) on `accelerator` when its
    matmuls would take torch's slow bf16 path on this CPU; None when they would not (GPU, float32, or a CPU
    with AVX512-BF16/AMX, or no /proc/cpuinfo to tell)."""
    if accelerator != "cpu" or (dtype or "bfloat16") != "bfloat16":
        return None
    flags = cpu_flags() if flags is None else flags
    if not flags or any(f in flags for f in NATIVE_BF16_FLAGS):
        return None
    return ("dtype bfloat16 on a CPU without AVX512-BF16/AMX: vLLM's oneDNN has no bf16 matmul here and falls "
            "back to torch's, ~70x slower than float32; set engine_kwargs.dtype: float32 (and twice "
            "kv_cache_bytes for the same tokens)")
