"""`kvtier bench replay-memory`: the learner replay's host and device memory per rank, measured.

The learner builds each forward's death tensor (`rollout.learner_replay.micro_batch_deaths`) one sample at a
time on the host and copies it into the micro-batch's tensor on its device; nothing dense is kept for the
batch. A fresh process builds one micro-batch of `micro_batch` samples at the given shape (Qwen3-4B: 36
layers, 8 KV heads; 32k tokens) and reports its peak resident memory above the same process after a warm-up
build (`host_bytes_per_rank`: what replay adds to a rank's host memory, whatever the batch size), the death
tensor a forward holds on the device (`device_bytes_per_rank`), and the seconds per sample. Beside them, what
the earlier per-process cache of dense tensors (up to 256 samples) held for the same batch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

HOST_LIMIT_BYTES = 1 << 30        # issue #41: under 1 GB of host memory per rank
CACHED_BEFORE = 256               # the lru_cache the learner kept until this benchmark existed


def _micro_batch(samples: int, prompt: int, tokens: int, fields: dict):
    import torch
    from tensordict import TensorDict

    ids = torch.nested.nested_tensor([torch.zeros(tokens, dtype=torch.long)] * samples, layout=torch.jagged)
    td = TensorDict({"input_ids": ids}, batch_size=[samples])
    td["prompts"] = torch.nested.nested_tensor([torch.zeros(prompt, dtype=torch.long)] * samples, layout=torch.jagged)
    td["extra_fields"] = [{**fields, "kvtier_seed": s} for s in range(samples)]
    return td


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(layers: int, kv_heads: int, tokens: int, prompt: int, budget: int, buffer: int, micro_batch: int) -> dict:
    """In this process: the resident memory's peak growth (sampled every millisecond) while one padded
    micro-batch is built, after a small warm-up build. The learner's device is this CPU here, so the growth
    includes the micro-batch's death tensor, which a GPU learner holds on the device instead."""
    from kvtier.rollout.learner_replay import micro_batch_deaths

    fields = {"kvtier_budget": budget, "kvtier_buffer": buffer, "kvtier_policy": "random", "kvtier_policy_params": None,
              "kvtier_preemptions": 0, "kvtier_generate_calls": 1}
    warm = _micro_batch(1, 16, 2 * (budget + 2 * buffer), fields)
    micro_batch_deaths(warm, 2 * (budget + 2 * buffer), packed=False, num_layers=2, num_kv_heads=2)
    mb = _micro_batch(micro_batch, prompt, tokens, fields)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    deaths, counts = micro_batch_deaths(mb, tokens, packed=False, num_layers=layers, num_kv_heads=kv_heads)
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    assert counts["replayed"] == micro_batch and tuple(deaths.shape) == (micro_batch, layers, kv_heads, tokens)
    device = deaths.numel() * deaths.element_size()
    return {"rss_peak_growth_bytes": max(peak[0], _rss()) - base, "seconds_per_sample": seconds / micro_batch,
            "death_tensor_bytes": device}


def run_replay_memory_bench(*, layers: int = 36, kv_heads: int = 8, tokens: int = 32768, prompt: int = 1024,
                            budget: int = 3072, buffer: int = 128, batch: int = 256, ranks: int = 1,
                            micro_batch: int = 1) -> dict:
    args = dict(layers=layers, kv_heads=kv_heads, tokens=tokens, prompt=prompt, budget=budget, buffer=buffer,
                micro_batch=micro_batch)
    proc = subprocess.run([sys.executable, "-m", "kvtier.benchmarks.replay_memory", json.dumps(args)],
                          capture_output=True, text=True, check=True)
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    per_sample = layers * kv_heads * tokens * 4                      # int32 deaths [layers, kv_heads, tokens]
    per_rank = math.ceil(batch / ranks)
    device = measured["death_tensor_bytes"]
    host = measured["rss_peak_growth_bytes"] - device       # on a GPU learner the micro-batch's tensor is there
    return {
        "shape": {**args, "batch": batch, "ranks": ranks, "samples_per_rank": per_rank},
        "bytes_per_sample": per_sample,
        "host_bytes_per_rank": host,
        "device_bytes_per_rank": device,
        "measured_rss_peak_growth_bytes": measured["rss_peak_growth_bytes"],
        "host_bytes_per_rank_cached_before": min(per_rank, CACHED_BEFORE) * per_sample,
        "seconds_per_sample": round(measured["seconds_per_sample"], 3),
        "host_limit_bytes": HOST_LIMIT_BYTES,
        "within_host_limit": host < HOST_LIMIT_BYTES,
    }


if __name__ == "__main__":      # the measuring child process
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
