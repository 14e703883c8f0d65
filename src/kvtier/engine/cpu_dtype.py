"""Whether this CPU computes bfloat16 natively, and the start-up line when an engine would run it without.

vLLM 0.31's CPU linear layers use a oneDNN matmul; oneDNN builds a bf16 one only with AVX512-BF16 or AMX.
Without (an AVX2 machine), `dispatch_cpu_unquantized_gemm` logs one debug-level warning and falls back to
torch's linear, whose bf16 GEMM there is a reference loop: 1.1 GFLOP/s against 78 for float32 on the same
core (2048x512 @ 512x1024, one thread, AMD EPYC with AVX2, torch 2.13). Outputs stay correct, so the engine
does not refuse. So `dtype: auto` (the default, `auto_dtype`) runs float32 on such a CPU and the model's own
dtype elsewhere; an explicit bfloat16 there is kept, and `kvtier serve` says once per engine what it costs.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo(field: str) -> str | None:
    """The first `field` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith(field))
    except (OSError, StopIteration):
        return None
    return line.split(":", 1)[1].strip()


def cpu_flags() -> set[str]:
    """The `flags` of /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_model() -> str | None:
    """/proc/cpuinfo's `model name` (None where there is none): what a training records it ran on."""
    return _cpuinfo("model name")


def native_bf16(flags: set[str] | None = None) -> bool | None:
    """Whether this CPU has AVX512-BF16 or AMX; None where /proc/cpuinfo cannot tell."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS) if flags else None


def auto_dtype(accelerator: str, flags: set[str] | None = None) -> tuple[str | None, str | None]:
    """(dtype, why) for an engine or a training whose dtype is `auto`: float32 on a CPU without native bf16,
    else None (the model's own dtype, vLLM's and transformers' `auto`) and no reason to log."""
    if accelerator != "cpu" or native_bf16(flags) is not False:
        return None, None
    return "float32", ("dtype auto = float32: this CPU has no AVX512-BF16/AMX, where bfloat16 matmuls take "
                       "torch's fallback (~70x slower); KV entries are 4 bytes, so kv_cache_bytes holds half the tokens")


def resolve_dtype(requested: str | None, accelerator: str, flags: set[str] | None = None) -> tuple[str | None, str | None]:
    """(dtype, why) for a dtype setting: `auto` (or unset) as `auto_dtype` resolves it, a name as itself."""
    if requested in (None, "auto"):
        return auto_dtype(accelerator, flags)
    return str(requested), None


def bf16_slow_path_note(dtype: str | None, accelerator: str, flags: set[str] | None = None) -> str | None:
    """One line for an engine given `dtype` explicitly (None: the model's, bfloat16 for kvtier's models) on
    `accelerator` when its matmuls would take torch's slow bf16 path on this CPU; None when they would not
    (GPU, float32, or a CPU with AVX512-BF16/AMX, or no /proc/cpuinfo to tell)."""
    if accelerator != "cpu" or (dtype or "bfloat16") != "bfloat16" or native_bf16(flags) is not False:
        return None
    return ("dtype bfloat16 on a CPU without AVX512-BF16/AMX: vLLM's oneDNN has no bf16 matmul here and falls "
            "back to torch's, ~70x slower than float32; set engine_kwargs.dtype: float32 (and twice "
            "kv_cache_bytes for the same tokens)")
