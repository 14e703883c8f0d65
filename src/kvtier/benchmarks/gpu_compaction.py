"""`kvtier bench compaction` on a GPU machine that has torch but neither vLLM nor an installed kvtier.

Same measurement and JSON as `kvtier bench compaction` (kvtier.benchmarks.compaction): ms per engine step
for compacting every due request (selection + hole-filling row copies + slot maps) on a paged cache at
Qwen3-4B shapes, against a full per-head gather, with a bit-exactness check per cell. It needs torch
(and numpy) only: run it as a module from the checkout's `src/` (no install needed; what it imports pulls
in no vLLM, pydantic, typer or Ray).

On the H200 (device `run` tool, repository root, no carry; JSON to $OUT, rewritten after every cell so
a run stopped by its timeout still returns the cells it finished; progress lines on stderr):

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -m kvtier.benchmarks.gpu_compaction --repeats 5 --out $OUT/compaction-h200.json

with timeout_s=270. Defaults: --device cuda --requests 1,64,256 --budgets 1024,2048 --layouts flash,cpu
--policies random,snapkv,rkv. At K=2048 the 256-request cell holds an 82 GB cache; it fits the H200
because the pristine cache is regenerated per layer from its seed instead of cloned; cells estimated
above 75% of free device memory (the `cpu` layout's one-element rows at 256 x 2048: int64 row indices
of ~39 GB on top of the cache) are listed under `skipped`. Not run on a GPU yet (no device in the
session that wrote it): if time runs short, `--layouts flash` first.
CPU smoke test: `PYTHONPATH=src python -m kvtier.benchmarks.gpu_compaction --tiny --device cpu`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (2 layers, 2 heads, d=32, K=32, r=8, 3 requests)")
    ap.add_argument("--requests", default=None, help="comma-separated (default: cuda 1,64,256; cpu 1,8)")
    ap.add_argument("--budgets", default="1024,2048")
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--query-heads", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--layouts", default="flash,cpu")
    ap.add_argument("--policies", default="random,snapkv,rkv")
    ap.add_argument("--repeats", type=int, default=None, help="default: cuda 10, cpu 3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-gb", type=float, default=None, help="skip cells estimated to need more (default: cuda 75%% of free memory)")
    ap.add_argument("--cpu-writer", default="auto", choices=("auto", "vllm", "emulated"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvtier.benchmarks.compaction import CompactionShapes, run_compaction_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    if args.tiny:
        shapes = CompactionShapes(layers=2, kv_heads=2, head_dim=32, block_size=16, buffer=8, query_heads=4, prompt_len=8)
        requests, budgets = [3], [32]
    else:
        shapes = CompactionShapes(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                  block_size=args.block_size, buffer=args.buffer, query_heads=args.query_heads,
                                  prompt_len=args.prompt_len)
        requests, budgets = (ints(args.requests) if args.requests else None), ints(args.budgets)

    def write(report: dict) -> None:
        """After every cell (an interrupted run keeps what it measured), and at the end."""
        c = report["cells"][-1] if report["cells"] else None
        if c is not None:
            print(f"[{c['layout']} K={c['budget']} n={c['requests']}] floor {c['floor_ms_per_step']} ms "
                  + " ".join(f"{k} {v['ms_per_step']} ms x{v['ratio_to_floor']} exact={v['exact']}"
                             for k, v in c["policies"].items()), file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    report = run_compaction_bench(device=device, requests=requests, budgets=budgets, shapes=shapes,
                                  layouts=args.layouts.split(","), policies=args.policies.split(","),
                                  repeats=args.repeats, dtype=args.dtype, max_gb=args.max_gb,
                                  seed=args.seed, cpu_writer=args.cpu_writer, progress=write)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
