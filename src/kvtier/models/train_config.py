"""What a reasoner training computes (``TrainConfig``: every field a ``train-reasoner`` flag), its precision, and
its learning-rate schedule; reasoner_train.py runs it.

Precision (``dtype``, issue #36): ``bfloat16`` runs the matmuls under bf16 autocast, ``float32`` without;
weights and optimizer state are fp32 either way. ``auto`` (the default) resolves to bfloat16 on CUDA and on
CPUs with native bf16 (AVX512-BF16 or AMX: kvtier.engine.cpu_dtype's flags, the detector `kvtier serve`
warns with) and to float32 elsewhere, where torch emulates bf16: on an AVX2 CPU a step (batch 8) took 2.9 s
in bf16 and 1.55 s in float32. TRAINING.json records the requested and resolved dtype with the reason, and
``speed``: the steps this invocation ran per second (``--steps 24 --dtype float32`` against ``--dtype
bfloat16`` into two scratch ``--out`` directories measures both; docs/reasoner.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.engine import cpu_dtype
from kvtier.tasks import chains as rt


@dataclass
class TrainConfig:
    seed: int = rt.TRAIN_SEED      # data seed (problems) and init seed
    steps: int = 2000
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.1
    threads: int = 2
    dtype: str = "auto"            # matmul precision: auto | float32 | bfloat16 (autocast; weights and optimizer stay fp32)
    log_every: int = 25
    eval_every: int = 250          # held-out teacher-forced check logged into the loss curve
    ckpt_every: int = 50
    held_out: int = 16             # held-out problems per kind for the teacher-forced check
    init_from: str = ""            # a trained model directory to continue from (a second phase); "": random init
    short_batch: int = 0           # extra short local chains per step (SHORT_N lines): more trace starts, low counters
    answer_weight: float = 1.0     # loss weight of the boxed answer's tokens (one answer per ~1,000 trace tokens)
    aux_family: str = ""           # with aux_batch: another task family whose problems join every step, e.g. chains
    aux_batch: int = 0             # for retrieval at its shorter distances; half local chains, half needles
    evict: str = ""                # "POLICY:K[,K...][:r]": train under simulated eviction (train_eviction.py)
    full_share: float = 0.25       # with evict: the share of samples under full attention
    family: str = rt.DEFAULT_FAMILY  # the task family (kvtier.tasks.chains.FAMILIES)
    shape: str = "base"            # the model's shape (reasoner.SHAPES); with init_from, the model's own
    device: str = "cpu"            # cpu | cuda[:i]: where the steps run (not part of what a checkpoint must match)
    workers: int = 0               # with evict: processes simulating the evictions ahead of the steps (DeathsAhead)
    attention: str = "auto"        # with evict: death-time attention backend, auto (kvtier.deathtime's per device) | mask | flex


DTYPES = ("auto", "float32", "bfloat16")
# How a run is executed, not what it computes: a checkpoint resumes across them (TRAINING.json's `devices`
# records where each stretch of steps ran; a GPU's float sums differ from a CPU's in the last bits).
RUN_ONLY = ("device", "workers", "attention")
ATTENTION = ("auto", "mask", "flex")   # kvtier.deathtime.attention.BACKEND's choices; auto keeps its per-device one


def resolve_dtype(requested: str, device: str = "cpu", flags: set[str] | None = None) -> tuple[str, str]:
    """(float32 | bfloat16, why) for `--dtype requested` on `device`. auto: bfloat16 on CUDA and on a CPU
    with AVX512-BF16 or AMX, float32 otherwise: torch would emulate bf16, or /proc/cpuinfo cannot tell (the
    one detector: kvtier.engine.cpu_dtype, which `kvtier serve`'s dtype auto reads too; `flags`: a test's)."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    native = None if device.startswith("cuda") else cpu_dtype.native_bf16(flags)
    if requested != "auto":
        slow = requested == "bfloat16" and native is False    # honoured (a recipe names its dtype), but said
        return requested, f"--dtype {requested} given" + (
            "; this CPU has neither AVX512-BF16 nor AMX: torch emulates bf16, ~2-3x slower steps than float32"
            if slow else "")
    if device.startswith("cuda"):
        return "bfloat16", "auto: CUDA computes bf16 natively"
    if native:
        return "bfloat16", "auto: this CPU has AVX512-BF16 or AMX (native bf16 matmuls)"
    if native is None:
        return "float32", "auto: no CPU flags to read (/proc/cpuinfo): float32, never emulated bf16"
    return "float32", ("auto: this CPU has neither AVX512-BF16 nor AMX, where torch emulates bf16 (an AVX2 CPU's "
                       "step, batch 8: 2.9 s in bf16, 1.55 s in float32)")


def saved_config(saved: dict) -> dict:
    """A checkpoint's config in today's fields (before #36: `bf16` true/false, no family)."""
    saved = dict(saved)
    if "bf16" in saved:
        saved["dtype"] = "bfloat16" if saved.pop("bf16") else "float32"
    saved.setdefault("family", rt.DEFAULT_FAMILY)
    saved.setdefault("shape", "base")
    saved.setdefault("aux_family", "")
    saved.setdefault("aux_batch", 0)
    return saved


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over `warmup` steps, then cosine down to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
