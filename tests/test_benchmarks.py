"""Benchmark commands produce complete, validated JSON (no timings asserted: speed claims come from the
benchmark runs themselves, reported in the issue notes)."""

import json
import subprocess
import sys


def run_json(args):
    """Run `kvtier ARGS` in a fresh process (as a user would) and parse its JSON output."""
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_bench_rounds_reports_every_policy_against_the_gather_floor():
    r = run_json(["bench", "rounds", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--budget", "64",
                  "--buffer", "16", "--query-heads", "4", "--prompt-len", "8", "--repeats", "2"])
    from kvtier.policies import available

    assert r["full_gather_floor"]["ms_per_round"] > 0
    for name in ("random", "random_shared", "random_block", "recency", "streaming", "snapkv"):
        assert r["policies"][name]["ms_per_round"] > 0
        assert r["policies"][name]["ratio_to_full_gather"] > 0
    assert set(r["policies"]) == set(available())


def test_bench_throughput_smoke_counts_evictions(tmp_path):
    plot = tmp_path / "tp.png"
    r = run_json(["bench", "throughput", "--requests", "3", "--prompt-tokens", "32", "--gen-tokens", "200",
                  "--budget", "64", "--buffer", "16", "--policies", "full,random,snapkv",
                  "--kv-bytes", str(3 << 20), "--plot", str(plot)])
    assert r["valid"] and plot.stat().st_size > 1000
    assert r["arms"]["full"]["eviction_events"] == 0 and r["arms"]["full"]["ratio_to_full"] == 1.0
    for arm in ("random", "snapkv"):
        a = r["arms"][arm]
        assert a["generated_tokens"] == 600
        assert a["eviction_events"] >= 3 * 7, a   # 3 requests, a round every 16 tokens past K + r
        assert a["tokens_evicted"] > 0 and a["preemptions"] == 0


def test_bench_capacity_matches_block_arithmetic():
    r = run_json(["bench", "capacity", "--budget", "100", "--buffer", "14", "--prompt-tokens", "32",
                  "--gen-tokens", "300", "--kv-bytes", str(7 * 4 * 2 * 64 * 2 * 2 * 128)])
    # 6 usable blocks: full sequences need 3 blocks (332 tokens), compressed ones 1 (K + 2r = 128)
    assert r["blocks_per_sequence"] == {"full": 3, "compressed": 1}
    assert r["predicted"] == {"full": 2, "compressed": 6}
    assert r["measured"]["compressed"] > r["measured"]["full"] >= 1
    assert all(r["matches_block_arithmetic"].values()), r
    assert r["valid"]


def test_bench_prefix_cache_smoke_counts_prompt_tokens_computed(tmp_path):
    """2 prompts x 4 samples of 300 tokens at K=320 (random protects the prompt: 2 whole blocks shared):
    without prefix caching every prompt token is computed; with it the first sample of each prompt computes
    its 300 and the other three only the 44 past the shared blocks (same-step hits), which vLLM's own
    counters see as 256-token hits on all eight lookups but the first two. Evictions ran in both arms."""
    out, plot = tmp_path / "pc.json", tmp_path / "pc.png"
    r = run_json(["bench", "prefix-cache", "--prompts", "2", "--samples", "4", "--prompt-tokens", "300",
                  "--gen-tokens", "150", "--budget", "320", "--buffer", "32", "--kv-blocks", "12", "--arms", "k,k+pc",
                  "--out", str(out), "--plot", str(plot)])
    assert json.loads(out.read_text())["arms"].keys() == {"k", "k+pc"} and plot.stat().st_size > 1000
    k, kpc = r["arms"]["k"], r["arms"]["k+pc"]
    assert k["prompt_tokens_computed"] == k["prompt_tokens_offered"] == 8 * 300
    assert kpc["prompt_tokens_computed"] == 2 * 300 + 6 * (300 - 256)
    assert (kpc["prefix_cache_queries"], kpc["prefix_cache_hits"]) == (8 * 300, 6 * 256)
    assert r["ratios"]["prompt_tokens_saved"]["k"] == 1 - (2 * 300 + 6 * 44) / 2400
    for a in (k, kpc):
        assert a["generated_tokens"] == 8 * 150 and a["eviction_events"] > 0 and a["preemptions"] == 0
        assert a["free_blocks_after"] == 12


def test_bench_capacity_gpu_arithmetic_is_the_docs_table():
    """`kvtier bench capacity --gpu` (arithmetic, no engine): Qwen3-8B's KV pool on H100/H200 over each gpu.yaml
    tier's reserve bound. docs/deploy.md's table is its output, and every row stays under the batch default
    that `max_num_seqs: auto` keeps there (no kv_cache_bytes: vLLM 0.31's, 1024 on a >= 70 GiB H100)."""
    from pathlib import Path

    from kvtier.benchmarks.capacity import GPU_MEMORY, QWEN3_8B, capacity_markdown, gpu_capacity
    from kvtier.service.config import load_config
    from kvtier.service.sizing import kv_bytes_per_token, resolved_engine_kwargs

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "src" / "kvtier" / "configs" / "gpu.yaml")
    assert kv_bytes_per_token(QWEN3_8B) == 36 * 8 * 128 * 2 * 2      # layers * KV heads * head_dim * (K, V) * bf16
    r = gpu_capacity(cfg, ["H100", "H200"])
    h100, h200 = r["gpus"]["H100"]["shared"], r["gpus"]["H200"]["shared"]
    assert h100["block_size"] == 16 and h100["tiers"]["full"]["blocks_per_trace"] == 32768 // 16
    assert h100["tiers"]["k1024"]["blocks_per_trace"] == (1024 + 2 * 64) // 16   # K + 2r: its prompt (<= K/2) fits
    assert h200["pool_blocks"] > h100["pool_blocks"]
    for engines in r["gpus"].values():
        for eng in engines.values():
            for t in eng["tiers"].values():
                assert 0 < t["traces"] == eng["pool_blocks"] // t["blocks_per_trace"] < 1024
    for name, eng in cfg.engines.items():
        assert eng.engine_kwargs["max_num_seqs"] == "auto" and eng.kv_cache_bytes is None
        assert "max_num_seqs" not in resolved_engine_kwargs(cfg, name, eng.model)[0]
    assert capacity_markdown(r) in (repo / "docs" / "deploy.md").read_text()

    probe = ("import vllm.platforms as P; from vllm.platforms.interface import UnspecifiedPlatform\n"
             "class H100(UnspecifiedPlatform):\n"
             f"    def get_device_total_memory(self, device_id=0): return {GPU_MEMORY['H100']}\n"
             "    def get_device_name(self, device_id=0): return 'NVIDIA H100 80GB HBM3'\n"
             "P._current_platform = H100()\n"
             "from vllm.engine.arg_utils import EngineArgs\n"
             "print(sorted(set(EngineArgs.get_batch_defaults(1)[1].values())))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[1024]"
