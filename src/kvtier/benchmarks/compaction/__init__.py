"""`kvtier bench compaction`: one engine step's compaction of every due request on a paged KV cache.

What the compressed engine's worker does at the start of a step where `n` requests are due a round
(`src/kvtier/engine/worker_side.py`), reproduced without vLLM on the torch-only pieces it uses, timed
against the floor (a full per-head gather) and checked bit for bit. The package, one job a module:

* `layouts`: the shapes (Qwen3-4B by default) and a paged cache per layer in a backend's own layout
  (`flash`, `cpu`, `cpu_plain`), written through that backend's cache-update op (vLLM's own, or a
  torch emulation) and probed as the worker probes it;
* `cell`: one cell, `n` due requests at budget K: their caches, blocks, slot maps and request state,
  and the untimed restore / re-arm between timed steps;
* `batched_step`: kvtier's arm, victim selection for every due request as the worker calls it, then
  `apply_rounds` for all and the slot-map update;
* `floor_step`: the floor, `full_gather_plan` per request through the same paged row copies;
* `exactness`: the check after the first (warm-up) step, kept K/V rows bit-identical to the pristine
  cache at exactly the positions not evicted, each where the updated slot map says;
* `report`: the driver, timings per cell (median of `repeats` steps), the memory cap (`skipped`), the
  JSON report and its summary against the targets.

It imports torch and numpy only (vLLM lazily, for the `cpu` writer, when it is there): the GPU launcher
`kvtier.benchmarks.gpu_compaction` runs it where vLLM, pydantic, typer and Ray are not installed.
The names below are this package's public interface (`kvtier bench compaction`, the GPU launcher and
the tests import them from here).
"""

from kvtier.benchmarks.compaction.batched_step import PER_LAYER_POLICIES, batched_step, select_keyed, select_one
from kvtier.benchmarks.compaction.cell import Cell
from kvtier.benchmarks.compaction.exactness import check_step, kept_slots
from kvtier.benchmarks.compaction.floor_step import FLOOR_INDEX_BYTES, floor_keep, floor_step
from kvtier.benchmarks.compaction.layouts import (LAYOUTS, CompactionShapes, LayoutWriter, cache_bytes, cache_shape,
                                                  cpu_plain_write, cpu_vec_write, flash_write, layout_writer,
                                                  pool_size, vllm_cpu_writer)
from kvtier.benchmarks.compaction.report import TARGETS, cell_memory, measure_cell, run_compaction_bench
from kvtier.policies import make_policy

__all__ = [
    "FLOOR_INDEX_BYTES", "LAYOUTS", "PER_LAYER_POLICIES", "TARGETS", "Cell", "CompactionShapes", "LayoutWriter",
    "batched_step", "cache_bytes", "cache_shape", "cell_memory", "check_step", "cpu_plain_write", "cpu_vec_write",
    "flash_write", "floor_keep", "floor_step", "kept_slots", "layout_writer", "make_policy", "measure_cell",
    "pool_size", "run_compaction_bench", "select_keyed", "select_one", "vllm_cpu_writer",
]
