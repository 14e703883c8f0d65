"""`kvtier bench replay-memory`: the learner replay's host time and memory per rank, measured.

The learner builds each forward's death tensor (`rollout.learner_replay.micro_batch_deaths`) one sample at a
time on the host and copies it into the micro-batch's tensor on its device; a bounded store keeps each sample
compactly so a step's forwards (reference, old log-probs, update: `forwards`) derive it once. A fresh process
builds one micro-batch of `micro_batch` samples at the given shape (Qwen3-4B: 36 layers, 8 KV heads; 32k
tokens) twice: derived (a store miss) and served (a hit). It reports the peak resident memory of the first
build above the same process after a warm-up (the transient part), the store's bytes per sample, the seconds
(wall and CPU) per sample of each build, the CPU seconds of one derivation alone (`simulate_encoded`, what the
workers run; a build adds assembling: `derivation_cpu_seconds`), the host's part of serving a stored sample when
the learner's device is an accelerator (the device expands the compact form; timed on the meta device:
`served_host_cpu_seconds_per_sample_device_learner`, the bus transfer of 1-2 bytes a key not counted), and from
them a step on one rank (`host_cpu_seconds_per_sample_per_step_device_learner`: one derivation and `forwards`
servings, issue #60's figure): `samples_per_rank`
samples, the first `samples_stored_per_rank` derived once and served `forwards - 1` times, the rest derived
every forward.
`host_bytes_per_rank` is the transient peak plus the store holding those samples. Beside them, what the
earlier per-process cache of dense tensors (up to 256 samples) held for the same batch.

`critical_path` (`measure_workers`, another fresh process): what the forwards *wait for*, with the background
workers (`rollout.replay_prefetch`, `workers` threads or processes) against none (`serial`: each forward
derives what the store lacks itself), over one step of `worker_samples` samples and `forwards` passes, the
whole batch queued when each forward starts, as the replay engine does. `device_seconds` per sample stands for
the device's forward between two micro-batches (time the workers derive in; 0: none, the host alone). The
figure is the wait summed over the step's forwards, per sample, and the peak resident growth with the workers.
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
    micro-batch is derived, after a small warm-up build, then the same micro-batch served from the store. The
    learner's device is this CPU here, so the growth includes the micro-batch's death tensor, which a GPU
    learner holds on the device instead."""
    from kvtier.deathtime.simulate import simulate_encoded
    from kvtier.deathtime.store import DeathStore
    from kvtier.policies import EvictionSchedule, make_policy
    from kvtier.rollout.replay_batch import micro_batch_deaths

    fields = {"kvtier_budget": budget, "kvtier_buffer": buffer, "kvtier_policy": "random", "kvtier_policy_params": None,
              "kvtier_preemptions": 0, "kvtier_generate_calls": 1}
    warm = _micro_batch(1, 16, 2 * (budget + 2 * buffer), fields)
    micro_batch_deaths(warm, 2 * (budget + 2 * buffer), packed=False, num_layers=2, num_kv_heads=2, store=DeathStore(0))
    mb = _micro_batch(micro_batch, prompt, tokens, fields)
    store = DeathStore(1 << 62)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0, c0 = time.perf_counter(), time.process_time()
    deaths, counts = micro_batch_deaths(mb, tokens, packed=False, num_layers=layers, num_kv_heads=kv_heads, store=store)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    done.set()
    watcher.join()
    growth = max(peak[0], _rss()) - base - store.bytes          # the store's part is reported on its own
    del deaths
    t0, c0 = time.perf_counter(), time.process_time()
    served, _ = micro_batch_deaths(mb, tokens, packed=False, num_layers=layers, num_kv_heads=kv_heads, store=store)
    served_s, served_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert counts["replayed"] == micro_batch and tuple(served.shape) == (micro_batch, layers, kv_heads, tokens)
    assert store.derived == micro_batch and store.hits == micro_batch
    tensor_bytes = served.numel() * served.element_size()
    del served
    # the host's part of serving when the learner's device is an accelerator: the same call on the meta device runs
    # every host step (store lookup, hand-over of the compact arrays) and no device work (replay_batch.expand)
    c0 = time.process_time()
    micro_batch_deaths(mb, tokens, packed=False, num_layers=layers, num_kv_heads=kv_heads, store=store, device="meta")
    served_host_cpu = time.process_time() - c0
    c0 = time.process_time()                           # the derivation alone (a fresh seed), as issue #60 counts it
    simulate_encoded(make_policy("random"), EvictionSchedule(budget, buffer), prompt, tokens, num_layers=layers,
                    num_kv_heads=kv_heads, seed=micro_batch)
    derivation_cpu = time.process_time() - c0
    return {"rss_peak_growth_bytes": growth, "seconds_per_sample": seconds / micro_batch,
            "derivation_cpu_seconds": derivation_cpu,
            "cpu_seconds_per_sample": cpu / micro_batch, "served_seconds_per_sample": served_s / micro_batch,
            "served_cpu_seconds_per_sample": served_cpu / micro_batch,
            "served_host_cpu_seconds_per_sample_device_learner": served_host_cpu / micro_batch,
            "store_bytes_per_sample": store.bytes // micro_batch,
            "death_tensor_bytes": tensor_bytes}


def measure_workers(layers: int, kv_heads: int, tokens: int, prompt: int, budget: int, buffer: int, samples: int,
                    forwards: int, workers: int, kind: str, device_seconds: float) -> dict:
    """In this process: one step's forwards over `samples` one-sample micro-batches, first with no workers
    (serial), then through a `Prefetcher` of `workers`; the seconds the forwards spend waiting for deaths."""
    from kvtier.deathtime.store import DeathStore
    from kvtier.rollout.replay_batch import micro_batch_deaths, replayed_samples
    from kvtier.rollout.replay_prefetch import Prefetcher

    fields = {"kvtier_budget": budget, "kvtier_buffer": buffer, "kvtier_policy": "random", "kvtier_policy_params": None,
              "kvtier_preemptions": 0, "kvtier_generate_calls": 1}
    mbs = [_micro_batch(1, prompt, tokens, fields) for _ in range(samples)]
    for s, mb in enumerate(mbs):                       # a seed of its own each (a fresh derivation each)
        mb["extra_fields"] = [{**fields, "kvtier_seed": 1000 + s}]
    shape = dict(num_layers=layers, num_kv_heads=kv_heads)

    def step(store, pool) -> float:
        waited = 0.0
        for _ in range(forwards):
            if pool is not None:
                for mb in mbs:                         # the engine queues the forward's whole batch at once
                    pool.prefetch(replayed_samples(mb, **shape))
            for mb in mbs:
                t0 = time.perf_counter()
                micro_batch_deaths(mb, tokens, packed=False, **shape, store=pool or store)
                waited += time.perf_counter() - t0
                time.sleep(device_seconds)             # the device's forward: the host is free meanwhile
        return waited

    warm = _micro_batch(1, 16, 2 * (budget + 2 * buffer), {**fields, "kvtier_seed": 1})
    micro_batch_deaths(warm, 2 * (budget + 2 * buffer), packed=False, num_layers=2, num_kv_heads=2, store=DeathStore(0))
    serial = step(DeathStore(1 << 62), None)
    store = DeathStore(1 << 62)
    pool = Prefetcher(store, workers, kind)
    pool.prefetch(replayed_samples(warm, num_layers=2, num_kv_heads=2))        # starts the pool (spawn: imports)
    micro_batch_deaths(warm, 2 * (budget + 2 * buffer), packed=False, num_layers=2, num_kv_heads=2, store=pool)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0, c0 = time.perf_counter(), time.process_time()
    with_workers = step(store, pool)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    done.set()
    watcher.join()
    pool.shutdown()
    return {"serial_wait_seconds_per_sample_per_step": round(serial / samples, 3),
            "wait_seconds_per_sample_per_step": round(with_workers / samples, 3),
            "step_wall_seconds": round(wall, 2), "step_cpu_seconds_this_process": round(cpu, 2),
            "prefetched": pool.prefetched, "derived_by_forwards": pool.inline,
            "rss_peak_growth_bytes": max(peak[0], _rss()) - base}


def run_worker_bench(*, layers: int = 36, kv_heads: int = 8, tokens: int = 32768, prompt: int = 1024,
                     budget: int = 3072, buffer: int = 128, samples: int = 8, forwards: int = 3, workers: int = 2,
                     kind: str = "thread", device_seconds: float = 0.0) -> dict:
    """`measure_workers` in a fresh process, with its settings beside its figures."""
    args = dict(layers=layers, kv_heads=kv_heads, tokens=tokens, prompt=prompt, budget=budget, buffer=buffer,
                samples=samples, forwards=forwards, workers=workers, kind=kind, device_seconds=device_seconds)
    proc = subprocess.run([sys.executable, "-m", "kvtier.benchmarks.replay_memory", json.dumps(args), "workers"],
                          capture_output=True, text=True, check=True)
    return {"settings": {k: args[k] for k in ("samples", "forwards", "workers", "kind", "device_seconds")},
            **json.loads(proc.stdout.strip().splitlines()[-1]), "cpus": os.cpu_count()}


def run_replay_memory_bench(*, layers: int = 36, kv_heads: int = 8, tokens: int = 32768, prompt: int = 1024,
                            budget: int = 3072, buffer: int = 128, batch: int = 256, ranks: int = 1,
                            micro_batch: int = 1, forwards: int = 3, store_bytes: int | None = None,
                            workers: int = 2, pool: str = "thread", worker_samples: int = 8,
                            device_seconds: float = 0.0) -> dict:
    """The report (see the module). store_bytes: the store's bound (default: the learner's STORE_BYTES).
    workers (0: none), pool, worker_samples, device_seconds: the critical-path measurement's settings."""
    from kvtier.rollout.replay_batch import STORE_BYTES

    args = dict(layers=layers, kv_heads=kv_heads, tokens=tokens, prompt=prompt, budget=budget, buffer=buffer,
                micro_batch=micro_batch)
    proc = subprocess.run([sys.executable, "-m", "kvtier.benchmarks.replay_memory", json.dumps(args)],
                          capture_output=True, text=True, check=True)
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    per_sample = layers * kv_heads * tokens * 4                      # int32 deaths [layers, kv_heads, tokens]
    per_rank = math.ceil(batch / ranks)
    store_bytes = STORE_BYTES if store_bytes is None else int(store_bytes)
    stored = min(per_rank, store_bytes // max(m["store_bytes_per_sample"], 1))
    device = m["death_tensor_bytes"]
    host = m["rss_peak_growth_bytes"] - device + stored * m["store_bytes_per_sample"]   # a GPU learner's tensor is there
    derivations = per_rank + (forwards - 1) * (per_rank - stored)
    step = {key: round(derivations * m[k1] + (forwards - 1) * stored * m[k2], 2) for key, k1, k2 in (
        ("seconds", "seconds_per_sample", "served_seconds_per_sample"),
        ("cpu_seconds", "cpu_seconds_per_sample", "served_cpu_seconds_per_sample"))}
    return {
        "shape": {**args, "batch": batch, "ranks": ranks, "samples_per_rank": per_rank, "forwards": forwards},
        "bytes_per_sample": per_sample,
        "host_bytes_per_rank": host,
        "device_bytes_per_rank": device,
        "measured_rss_peak_growth_bytes": m["rss_peak_growth_bytes"],
        "host_bytes_per_rank_cached_before": min(per_rank, CACHED_BEFORE) * per_sample,
        "seconds_per_sample": round(m["seconds_per_sample"], 3),
        "cpu_seconds_per_sample": round(m["cpu_seconds_per_sample"], 3),
        "served_seconds_per_sample": round(m["served_seconds_per_sample"], 3),
        "derivation_cpu_seconds": round(m["derivation_cpu_seconds"], 3),
        "served_host_cpu_seconds_per_sample_device_learner": round(m["served_host_cpu_seconds_per_sample_device_learner"], 4),
        "store_bytes_per_sample": m["store_bytes_per_sample"],
        "store_max_bytes": store_bytes,
        "samples_stored_per_rank": stored,
        "derivations_per_step": derivations,
        "seconds_per_step": step["seconds"],
        "cpu_seconds_per_step": step["cpu_seconds"],
        "host_limit_bytes": HOST_LIMIT_BYTES,
        "within_host_limit": host < HOST_LIMIT_BYTES,
        # issue #60's figure for a learner on an accelerator: one derivation (in the store's form, by a worker or
        # inline) and the host's part of each forward's serving (the device expands: replay_batch.expand)
        "host_cpu_seconds_per_sample_per_step_device_learner": round(
            m["derivation_cpu_seconds"] + forwards * m["served_host_cpu_seconds_per_sample_device_learner"], 3),
        **({"critical_path": run_worker_bench(**{k: args[k] for k in args if k != "micro_batch"}, samples=worker_samples,
                                              forwards=forwards, workers=workers, kind=pool,
                                              device_seconds=device_seconds)} if workers > 0 else {}),
    }


if __name__ == "__main__":      # the measuring child process
    print(json.dumps((measure_workers if sys.argv[2:] == ["workers"] else measure)(**json.loads(sys.argv[1]))))
