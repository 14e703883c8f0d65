"""Death-time attention on a lent GPU (torch only: `PYTHONPATH=src python3 -m kvtier.benchmarks.gpu_deathtime
--out $OUT/deathtime-h200.json`): the CUDA path (compiled FlexAttention over the death tensor) against the
boolean-mask SDPA path, forward and backward, and each path's time and peak memory at a long trace.

CPU (the tests' machine) runs it with `--device cpu --length 256` as a smoke check of the same code
(forward only for FlexAttention, which has no CPU backward in torch 2.13).
"""

from __future__ import annotations

import argparse
import json
import time
import types


def run(device: str, length: int, heads: int, kv_heads: int, head_dim: int, batch: int, budget: int,
        buffer: int, dtype: str) -> dict:
    import torch

    from kvtier.deathtime import NEVER, simulate_deaths
    from kvtier.deathtime import attention as att
    from kvtier.policies import EvictionSchedule, make_policy

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, length, head_dim, generator=g).to(device, dt).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    prompt = min(64, budget // 2)
    deaths = torch.stack([simulate_deaths(make_policy("random"), EvictionSchedule(budget, buffer), prompt, length,
                                          num_layers=1, num_kv_heads=kv_heads, seed=s) for s in range(batch)])
    deaths = deaths.to(device)
    layer = types.SimpleNamespace(layer_idx=0, training=False)
    out = {}
    grads = {}
    for backend in ("mask", "flex"):
        att.BACKEND[torch.device(device).type] = backend
        for t in (q, k, v):
            t.grad = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backward = device.startswith("cuda") or backend == "mask"     # FlexAttention has no CPU backward
        args = (q, k, v) if backward else (q.detach(), k.detach(), v.detach())
        o, _ = att.deathtime_attention(layer, *args, None, kvtier_deaths=deaths)
        if backward:
            o.float().square().mean().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out[backend] = {"fwd_bwd_ms": round((time.perf_counter() - t0) * 1e3, 2),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None}
        grads[backend] = (o.detach().float(), *((t.grad.float() if backward else None) for t in (q, k, v)))
    diffs = [None if b is None else float((a - b).abs().max()) for a, b in zip(grads["mask"], grads["flex"])]
    return {"device": device, "torch": torch.__version__, "shape": dict(batch=batch, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, length=length, budget=budget, buffer=buffer, dtype=dtype),
            "evicted_share": float((deaths != NEVER).float().mean()), "backends": out,
            "max_abs_diff": {"out": diffs[0], "dq": diffs[1], "dk": diffs[2], "dv": diffs[3]}}


def main(argv=None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = run(a.device, a.length, a.heads, a.kv_heads, a.head_dim, a.batch, a.budget, a.buffer, a.dtype)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return res


if __name__ == "__main__":
    main()
