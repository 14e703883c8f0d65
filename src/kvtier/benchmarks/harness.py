"""Shared pieces of the engine benchmarks: one in-process compressed engine, an offered load, and the
scheduler-side observations (peak running batch, preemptions) the benchmarks report."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kvtier.models.tiny import TINY_CONFIG
from kvtier.service.sizing import CPU_BLOCK_SIZE, kv_bytes_per_token

TINY_BLOCK_TOKENS = CPU_BLOCK_SIZE   # the CPU benchmarks run the tiny model with vLLM's CPU KV block size
TINY_BLOCK_BYTES = kv_bytes_per_token(TINY_CONFIG) * TINY_BLOCK_TOKENS   # one bfloat16 KV block of the tiny Qwen3


@dataclass
class StepObserver:
    """Wraps one in-process scheduler instance to record the peak running batch, every preemption and the
    tokens every step scheduled (prefill chunks, recomputes and decode tokens alike)."""

    peak_running: int = 0
    preemptions: int = 0
    steps: int = 0
    scheduled_tokens: int = 0
    _sched: object = field(default=None, repr=False)

    def attach(self, llm) -> "StepObserver":
        from kvtier.engine.api import scheduler_of

        sched = self._sched = scheduler_of(llm)
        schedule, preempt = sched.schedule, sched._preempt_request

        def observed_schedule(*a, **kw):
            out = schedule(*a, **kw)
            self.steps += 1
            self.scheduled_tokens += out.total_num_scheduled_tokens
            self.peak_running = max(self.peak_running, len(sched.running))
            return out

        def observed_preempt(*a, **kw):
            self.preemptions += 1
            return preempt(*a, **kw)

        sched.schedule, sched._preempt_request = observed_schedule, observed_preempt
        return self

    def reset(self) -> None:
        self.peak_running = self.preemptions = self.steps = self.scheduled_tokens = 0


def build_bench_engine(model: str, kv_bytes: int, max_model_len: int, max_num_seqs: int, buffer: int,
                       admission: str = "reserve"):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvtier.engine.api import build_llm

    return build_llm(model, eviction={"default": {"buffer": buffer}, "admission": admission},
                     kv_cache_bytes=kv_bytes, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     enforce_eager=True, disable_log_stats=True)


def prompts_of(n: int, prompt_tokens: int, seed: int = 0, vocab: int = 4000) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist()} for _ in range(n)]


def run_load(llm, prompts: list[dict], params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs
