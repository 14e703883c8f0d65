"""`kvtier bench rounds`: cost of one eviction round (every layer of one step) per policy.

The floor is a full per-head gather compaction of the same shapes (what the paper's engine does every
round), timed in the same run: gather K+r survivors per head of K and V into preallocated buffers.
Policy rounds use hole-filling compaction over every layer at once (layers stacked as rows), as the
engine runs all compactions due in one step together.

What each policy is given (the engine supplies the same per layer): keys, values and the buffer's keys
from the cache; `queries` a window of 8 recent queries per query head; `h2o`'s timed round includes
what the engine does each round before selecting, adding the attention of the r queries since the last
round to the accumulated sums (an fp32 recomputation over every cached entry, `accumulated_attention`);
`triattention` a synthetic calibration (seeded normal series coefficients, uniform norm weights, RoPE
θ = 1e6 as Qwen3), one "layer" whose heads are the stacked rows — its cost does not depend on the
coefficient values, only on the shapes, so the bench needs no model. Like the vLLM worker, each policy
call gets `extras` {"num_layers": layers x batch, "state": a dict kept across the timed rounds (the
per-request state, `random_line_reserve`'s anchors)} and the newest buffer position as query_position;
the first (warm-up) round is the one that scores the whole cache. Each policy runs on its own copy of
the cache, and the rounds of all policies and the floor are timed round-robin (`_time_interleaved`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvtier.policies import (DenseHeadCache, EvictionSchedule, available, make_policy)
from kvtier.policies.h2o import accumulated_attention
from kvtier.policies.triattention import TriAttentionCalibration, rope_frequencies


@dataclass(frozen=True)
class RoundShapes:
    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    budget: int = 1024
    buffer: int = 64
    query_heads: int = 32
    prompt_len: int = 128
    batch: int = 1


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _fresh_cache(s: RoundShapes, device: str, gen: torch.Generator) -> DenseHeadCache:
    """Every layer of every request stacked as rows of one cache, at the moment a round is due: K + 2r
    entries per row, slots in a steady-state scrambled order, the prompt in the first slots."""
    rows, L = s.layers * s.batch * s.kv_heads, s.budget + 2 * s.buffer
    c = DenseHeadCache(rows, s.head_dim, L, dtype=torch.bfloat16, device=device)
    c.keys.normal_(generator=gen)
    c.values.normal_(generator=gen)
    n_gen = L - s.buffer - s.prompt_len  # generated positions held, scattered over a longer trace
    # older than the buffer (a round's candidates always are; random_line_reserve relies on it)
    held = s.prompt_len + torch.rand(rows, 4 * L - s.prompt_len, generator=gen, device=device).argsort(dim=1)[:, :n_gen]
    prompt = torch.arange(s.prompt_len, device=device).expand(rows, -1)
    c.positions[:, : L - s.buffer] = torch.cat([prompt, held], dim=1)
    c.positions[:, L - s.buffer :] = torch.arange(4 * L, 4 * L + s.buffer, device=device)
    c.length = L
    return c


def _rearm(c: DenseHeadCache, s: RoundShapes) -> int:
    """Put back r fresh buffer entries so the next round is due again (not timed); returns the newest
    position (the next round's query_position)."""
    settled = s.budget + s.buffer
    top = int(c.positions[:, :settled].max()) + 1
    c.positions[:, settled : settled + s.buffer] = torch.arange(top, top + s.buffer, device=c.positions.device)
    c.length = settled + s.buffer
    return top + s.buffer - 1


def _time_interleaved(timers: dict, repeats: int, device: str) -> dict[str, list[float]]:
    """ms of each timer's fn, `repeats` times, round-robin (the order rotated every pass): on a shared
    machine a burst of other work then lands on every policy alike, so ratios within a run hold. Each
    timer is (fn, rearm), warmed up by the caller; rearm (not timed) makes its next round due."""
    names = list(timers)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            fn, rearm = timers[name]
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out[name].append((time.perf_counter() - t0) * 1e3)
            rearm()
    return out


def _policy_extras(name: str, s: RoundShapes, device: str, gen: torch.Generator) -> dict:
    window = 8
    H, Hq = s.layers * s.batch * s.kv_heads, s.layers * s.batch * s.query_heads
    S = s.budget + s.buffer
    return {
        "queries": torch.randn(Hq, window, s.head_dim, generator=gen, device=device).to(torch.bfloat16),
        "attention": torch.rand(H, S, generator=gen, device=device),
        "query_position": 4 * (S + s.buffer) + s.buffer,
        "generator": gen,
    }


def synthetic_calibration(rows: int, head_dim: int, seed: int = 0, rope_theta: float = 1e6) -> TriAttentionCalibration:
    """A TriAttention calibration of the bench's shapes: one layer, `rows` heads (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    M = head_dim // 2
    return TriAttentionCalibration(
        cos_coef=torch.randn(1, rows, M, generator=g), sin_coef=torch.randn(1, rows, M, generator=g),
        norm_weight=torch.rand(1, rows, M, generator=g), omega=rope_frequencies(rope_theta, head_dim).float(),
        rope_style="half", rope_theta=rope_theta)


def _policy_params(name: str, s: RoundShapes) -> dict:
    if name == "triattention":
        return {"calibration": synthetic_calibration(s.layers * s.batch * s.kv_heads, s.head_dim)}
    return {}


def _h2o_round(policy, cache: DenseHeadCache, schedule: EvictionSchedule, s: RoundShapes, queries, extras: dict):
    """The engine's H2O round: add the attention of the r queries since the last round on every cached
    entry, hand the candidates' sums to the policy (chronological), evict."""
    n, n_cand = cache.length, schedule.num_candidates(cache.length)
    pos = cache.positions[:, :n]
    qpos = pos.max() - torch.arange(s.buffer - 1, -1, -1, device=pos.device)
    acc = accumulated_attention(cache.keys[:, :n], pos, queries, qpos)
    order = pos[:, :n_cand].argsort(dim=1)
    cache.evict_round(policy, schedule, s.prompt_len, attention=acc[:, :n_cand].gather(1, order), **extras)


def _policy_timer(name: str, s: RoundShapes, device: str, gen: torch.Generator, schedule: EvictionSchedule):
    """(fn, rearm) for one round of `name` on its own fresh cache (the same contents for every policy)."""
    policy = make_policy(name, **_policy_params(name, s))
    cache = _fresh_cache(s, device, torch.Generator(device=device).manual_seed(0))
    newest = [int(cache.positions[0, cache.length - 1])]   # the due round's query_position (host, as the engines)

    def rearm():
        newest[0] = _rearm(cache, s)

    extras = _policy_extras(name, s, device, gen)
    if "attention" in policy.needs:
        rq = torch.randn(s.layers * s.batch * s.query_heads, s.buffer, s.head_dim, generator=gen, device=device)
        rest = {k: v for k, v in extras.items() if k in ("generator", "query_position")}
        return (lambda q=rq.to(torch.bfloat16): _h2o_round(policy, cache, schedule, s, q, rest)), rearm
    extras = {k: v for k, v in extras.items() if k in policy.needs or k == "generator"}
    extras["extras"] = {"num_layers": s.layers * s.batch, "state": {}}
    return (lambda: cache.evict_round(policy, schedule, s.prompt_len, query_position=newest[0], **extras)), rearm


def run_rounds_bench(s: RoundShapes, *, device: str = "cpu", repeats: int = 20, policies: list[str] | None = None,
                     threads: int | None = 1) -> dict:
    """Every policy on its own cache (~180 MB at the paper's shapes), timed round-robin with the floor."""
    if threads and device == "cpu":
        torch.set_num_threads(threads)  # on a shared 2-core machine, 2 threads mostly measure contention
    gen = torch.Generator(device=device).manual_seed(0)
    schedule = EvictionSchedule(budget=s.budget, buffer=s.buffer)
    cache = _fresh_cache(s, device, torch.Generator(device=device).manual_seed(0))

    # Floor: a full per-head gather of K+r survivors of K and V, for every layer, into preallocated buffers.
    H, L, d = cache.keys.shape
    keep = torch.rand(H, L, generator=gen, device=device).argsort(dim=1)[:, : s.budget + s.buffer].sort(dim=1).values
    flat_idx = (keep + torch.arange(H, device=device).unsqueeze(1) * L).reshape(-1)
    out_k = torch.empty(H * (s.budget + s.buffer), d, dtype=torch.bfloat16, device=device)
    out_v = torch.empty_like(out_k)

    def full_gather():
        torch.index_select(cache.keys.view(H * L, d), 0, flat_idx, out=out_k)
        torch.index_select(cache.values.view(H * L, d), 0, flat_idx, out=out_v)

    moved_mb = 2 * 2 * H * (s.budget + s.buffer) * d * 2 / 1e6  # rows x (K and V) x (read + write) x bf16

    results: dict = {}
    timers = {"": (full_gather, lambda: None)}
    for name in policies or available():
        try:
            timers[name] = _policy_timer(name, s, device, gen, schedule)
        except Exception as exc:  # a policy that needs construction data the bench cannot make
            results[name] = {"skipped": str(exc)}
    for name in list(timers):   # warm-up; a policy that fails its first round is reported, not timed
        try:
            fn, rearm = timers[name]
            fn(); rearm(); _sync(device)
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            del timers[name]
    samples = _time_interleaved(timers, repeats, device)
    floor = statistics.median(samples.pop(""))
    for name, ms in samples.items():
        ms = statistics.median(ms)
        results[name] = {"ms_per_round": round(ms, 3), "ratio_to_full_gather": round(ms / floor, 4)}
    results = {n: results[n] for n in (policies or available()) if n in results}

    return {
        "device": device,
        "threads": torch.get_num_threads() if device == "cpu" else None,
        "torch": torch.__version__,
        "shapes": asdict(s),
        "repeats": repeats,
        "full_gather_floor": {"ms_per_round": round(floor, 3), "moved_mb": round(moved_mb, 1)},
        "policies": results,
        "compaction": "hole filling (only the r newest entries move); floor = full per-head gather",
        "timing": "medians of round-robin repeats (policies and floor interleaved, order rotated each pass)",
    }
