"""The checks of `kvtier engine check`, each run on the engine under check, each able to fail.

| check | asserts | a fault it catches |
|---|---|---|
| eviction | every compressed request ran rounds (the worker's applied-event counters) and its peak blocks stayed within ceil((K + 2r) / block size), below what full attention needs | compaction that never runs (a patch that is a silent no-op, e.g. under full CUDA graphs) |
| oracle | the sampled tokens' log-probs equal the masked-attention reference (`kvtier.reference.MaskedReplay`) on the engine's own logged keep-sets within the dtype's tolerance; without the masks they differ (the comparison has power) | a cache holding other entries than its keep-set (a shifted keep-set, a skipped copy, a wrong slot mapping) |
| blocks | the pool's free blocks come back after requests finish and after an abort mid-generation, past their rounds | a freed tail block not returned; a leak on abort |
| preemption | a forced preemption after rounds (vLLM's reset_prefix_cache with running requests, what RL weight syncs call): the requests recompute, finish, match the reference and return their blocks | stale offsets or keep-sets after preemption |
| prefix_cache | with prefix caching on, a second request with the same prompt reads exactly the whole blocks of its protected prompt, and a continuation of a compressed trace reads no block compaction rewrote and matches the reference | KV bleeding through the prefix cache (R-KV's vLLM bug #6) |
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kvtier.engine.api import pool_state, sampling_extra_args
from kvtier.engine.scheduler_side import prefix_cache_caps
from kvtier.engine.config import EvictionSpec
from kvtier.engine.stats import read_audit_log

from .results import CheckResult

BUFFER = 16
TOKENS = 520
# Above every prompt (random protects it), many rounds in TOKENS; K + r = 256 and 128 end on a block boundary
# for every power-of-two block size up to 128, so their rounds free a tail block (K + 2r is one block past)
BUDGETS = (240, 112, 176)
PROMPT_LENS = (40, 56, 72)
CONTROL_MIN = 0.3                  # without the masks the log-probs must move this much in some request
# engine dtype -> max |engine - float32 masked reference| (bf16 measured on CPU; fp16 assumed no worse)
TOLERANCE = {"bfloat16": 0.06, "float16": 0.06, "float32": 2e-3}
MAX_STEPS = 4000


def request_records(path: str, request_id: str) -> list[dict]:
    """One request's records of an audit log (vLLM suffixes internal request ids: '<id>-<hash>')."""
    if not Path(path).exists():
        return []
    return [r for r in read_audit_log(path) if r["req_id"] == request_id or r["req_id"].startswith(f"{request_id}-")]


def sampled_logprobs(out) -> torch.Tensor:
    """The engine's log-prob of each token it sampled (requests with logprobs=0)."""
    c = out.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])


def first_round_row(records: list[dict], prompt_len: int) -> int | None:
    """The first generated token's index whose query saw a compacted cache (None: no round)."""
    rounds = [r for r in records if "kept" in r]
    return min(r["query_position"] for r in rounds) + 2 - prompt_len if rounds else None


@dataclass
class EngineUnderCheck:
    llm: Any
    replay: Callable[[], Any]       # the masked reference (built on first use)
    audit_path: str
    tolerance: float
    tp_size: int
    prefix_caching: bool
    vocab: int

    def stats(self, request_ids) -> dict[str, dict | None]:
        """Per-request eviction counters from the worker (rank 0), by request id."""
        return self.llm.collective_rpc("kvtier_request_stats", args=(list(request_ids),))[0]

    def records(self, request_id: str) -> list[dict]:
        """The request's audit records; under tensor parallelism one record per round with every rank's heads."""
        if self.tp_size == 1:
            return request_records(self.audit_path, request_id)
        ranks = [request_records(f"{self.audit_path}.rank{r}", request_id) for r in range(self.tp_size)]
        merged = [r for r in ranks[0] if "reset_row" in r]
        for parts in zip(*[[r for r in recs if "kept" in r] for recs in ranks]):
            merged.append({**parts[0], "kept": [sum((p["kept"][layer] for p in parts), [])
                                                for layer in range(len(parts[0]["kept"]))]})
        return merged

    def blocks_freed(self) -> int:
        """Blocks the engine's rounds have handed back to the pool so far (the worker's counter)."""
        return self.llm.collective_rpc("kvtier_engine_stats")[0]["engine"]["blocks_freed"]

    def free_blocks(self) -> int:
        return pool_state(self.llm)["free_blocks"]

    @property
    def block_size(self) -> int:
        return pool_state(self.llm)["block_size"]


def params(max_tokens: int, **kvtier):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0,
                          extra_args=sampling_extra_args(**kvtier) or None)


def compressed(budget: int, seed: int, **more):
    return params(TOKENS, budget=budget, buffer=BUFFER, policy="random", seed=seed, **more)


class CheckRun:
    """One run of the checks: fresh prompts (no earlier prefix-cache entry matches them) and the shared
    batch of compressed requests, generated once for the eviction and oracle checks."""

    def __init__(self, engine: EngineUnderCheck, seed: int):
        self.e, self.seed = engine, seed
        self.rng = random.Random(seed)
        self._batch = None

    def prompt(self, n: int) -> dict:
        hi = min(self.e.vocab, 150_000) - 16     # clear of special and padding ids at the vocabulary's end
        return {"prompt_token_ids": [self.rng.randrange(16, hi) for _ in range(n)]}

    def batch(self):
        if self._batch is None:
            prompts = [self.prompt(n) for n in PROMPT_LENS]
            before = self.e.blocks_freed()
            self._batch = self.e.llm.generate(prompts, [compressed(k, self.seed + i) for i, k in enumerate(BUDGETS)],
                                              use_tqdm=False)
            self.batch_blocks_freed = self.e.blocks_freed() - before
        return self._batch

    def compare(self, out, records, *, control: bool) -> tuple[float, float | None]:
        """(max |engine - masked reference|, max |engine - unmasked| after the first round or None)."""
        eng = sampled_logprobs(out)
        ids, plen = list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids)
        replay = self.e.replay()
        err = float((eng - replay.logprobs(ids, plen, records, BUFFER)).abs().max())
        if not control:
            return err, None
        dense = (eng - replay.logprobs(ids, plen, [], BUFFER)).abs()[first_round_row(records, plen) or 0:]
        return err, float(dense.max()) if dense.numel() else 0.0

    def step_until(self, done: Callable[[], bool], outputs: dict) -> None:
        engine = self.e.llm.llm_engine
        for i in range(MAX_STEPS):
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = o
            if (i % 8 == 0 and done()) or not engine.has_unfinished_requests():
                return
        raise RuntimeError(f"the engine did not get there in {MAX_STEPS} steps")


def check_eviction(run: CheckRun) -> CheckResult:
    outs, bs = run.batch(), run.e.block_size
    stats = run.e.stats([o.request_id for o in outs])
    rows, bad = [], []
    for out, k in zip(outs, BUDGETS):
        st = stats.get(out.request_id) or {"events": 0, "tokens_evicted": 0, "peak_blocks": 0}
        bound = -(-(k + 2 * BUFFER) // bs)
        full = -(-(len(out.prompt_token_ids) + len(out.outputs[0].token_ids)) // bs)
        rows.append({"budget": k, "rounds": st["events"], "tokens_evicted": st["tokens_evicted"],
                     "peak_blocks": st["peak_blocks"], "bound_blocks": bound, "full_attention_blocks": full})
        if st["events"] == 0 or st["tokens_evicted"] == 0:
            bad.append(f"K={k}: no eviction applied")
        elif not 0 < st["peak_blocks"] <= bound:
            bad.append(f"K={k}: peak {st['peak_blocks']} blocks > bound {bound}")
    if run.batch_blocks_freed <= 0:
        bad.append("no round returned a tail block to the pool")
    rounds = [r["rounds"] for r in rows]
    figure = (f"{len(rows)} requests, {min(rounds)}-{max(rounds)} rounds each, {run.batch_blocks_freed} blocks "
              f"freed by rounds; peak blocks "
              f"{'/'.join(str(r['peak_blocks']) for r in rows)} <= bound {'/'.join(str(r['bound_blocks']) for r in rows)} "
              f"(full attention: {'/'.join(str(r['full_attention_blocks']) for r in rows)}; block size {bs})")
    return CheckResult("eviction", "FAIL" if bad else "PASS", "; ".join(bad + [figure]),
                       {"requests": rows, "blocks_freed": run.batch_blocks_freed})


def check_oracle(run: CheckRun) -> CheckResult:
    tol, rows, bad = run.e.tolerance, [], []
    for out, k in zip(run.batch(), BUDGETS):
        recs = run.e.records(out.request_id)
        n_rounds = len([r for r in recs if "kept" in r])
        if n_rounds == 0:
            bad.append(f"K={k}: no keep-set logged")
            continue
        err, dense = run.compare(out, recs, control=True)
        rows.append({"budget": k, "rounds_logged": n_rounds, "max_error": err, "max_error_unmasked": dense})
        if not err < tol:
            bad.append(f"K={k}: max |engine - masked reference| {err:.4f} >= {tol}")
        if not dense > 2 * tol:
            bad.append(f"K={k}: without the masks only {dense:.4f} (<= 2 x tolerance): this comparison has no power")
    figure = ""
    if rows:
        control = max(r["max_error_unmasked"] for r in rows)
        if not control > CONTROL_MIN:
            bad.append(f"without the masks at most {control:.4f} (<= {CONTROL_MIN}): the comparison has no power")
        figure = (f"max |engine - masked reference| {max(r['max_error'] for r in rows):.4f} (tolerance {tol}); "
                  f"unmasked control {min(r['max_error_unmasked'] for r in rows):.2f}-{control:.2f} (each must "
                  f"exceed {2 * tol:g}, the largest {CONTROL_MIN})")
    return CheckResult("oracle", "FAIL" if bad else "PASS", "; ".join(bad + [figure] if figure else bad),
                       {"requests": rows, "tolerance": tol, "control_min": CONTROL_MIN})


def check_blocks(run: CheckRun) -> CheckResult:
    e = run.e
    before = e.free_blocks()
    outs = e.llm.generate([run.prompt(n) for n in PROMPT_LENS], [compressed(k, run.seed + 10 + i)
                                                                 for i, k in enumerate(BUDGETS)], use_tqdm=False)
    after_finish = e.free_blocks()
    engine, ids = e.llm.llm_engine, [f"kvtier-check-abort-{run.seed}-{i}" for i in range(len(BUDGETS))]
    for i, (rid, k) in enumerate(zip(ids, BUDGETS)):
        engine.add_request(rid, run.prompt(PROMPT_LENS[i]), params(4 * TOKENS, budget=k, buffer=BUFFER, policy="random"))
    run.step_until(lambda: all((s or {}).get("events", 0) >= 2 for s in e.stats(ids).values()), {})
    held = e.free_blocks()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    after_abort = e.free_blocks()
    details = {"free_before": before, "free_after_finish": after_finish, "free_while_running": held,
               "free_after_abort": after_abort, "finished_tokens": [len(o.outputs[0].token_ids) for o in outs]}
    bad = []
    if after_finish != before:
        bad.append(f"after finish {after_finish} free blocks, {before} before")
    if held >= before:
        bad.append("the aborted requests held no blocks (the check did not exercise abort)")
    if after_abort != before:
        bad.append(f"after abort mid-generation {after_abort} free blocks, {before} before")
    figure = (f"free blocks {before} before, {after_finish} after finish, {held} while running, "
              f"{after_abort} after abort past 2 rounds")
    return CheckResult("blocks", "FAIL" if bad else "PASS", "; ".join(bad + [figure]), details)


def check_preemption(run: CheckRun) -> CheckResult:
    e = run.e
    before = e.free_blocks()
    engine, ids = e.llm.llm_engine, [f"kvtier-check-preempt-{run.seed}-{i}" for i in range(2)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, run.prompt(PROMPT_LENS[i]), compressed(BUDGETS[i], run.seed + 20 + i))
    outputs: dict = {}
    run.step_until(lambda: all((s or {}).get("events", 0) >= 2 for s in e.stats(ids).values()), outputs)
    reset = e.llm.reset_prefix_cache(reset_running_requests=True)
    run.step_until(lambda: False, outputs)
    stats, rows, bad = e.stats(ids), [], []
    for rid in ids:
        out, st, recs = outputs.get(rid), stats.get(rid) or {}, e.records(rid)
        if out is None or len(out.outputs[0].token_ids) != TOKENS:
            bad.append(f"{rid}: did not finish its {TOKENS} tokens")
            continue
        resets = [r["reset_row"] for r in recs if "reset_row" in r]
        err, _ = run.compare(out, recs, control=False)
        rows.append({"preemptions": st.get("preemptions", 0), "reset_rows": resets, "rounds": st.get("events", 0),
                     "max_error": err})
        if not resets or st.get("preemptions", 0) < 1:
            bad.append(f"{rid}: not preempted (reset_prefix_cache returned {reset})")
        if not err < e.tolerance:
            bad.append(f"{rid}: after the recompute max |engine - masked reference| {err:.4f} >= {e.tolerance}")
    after = e.free_blocks()
    if after != before:
        bad.append(f"{after} free blocks after, {before} before")
    figure = ""
    if rows:
        figure = (f"{len(rows)} requests preempted after rounds, recomputed and finished; max |engine - masked "
                  f"reference| {max(r['max_error'] for r in rows):.4f}; free blocks {before} -> {after}")
    return CheckResult("preemption", "FAIL" if bad else "PASS", "; ".join(bad + ([figure] if figure else [])),
                       {"requests": rows, "free_before": before, "free_after": after})


def check_prefix_cache(run: CheckRun) -> CheckResult:
    e = run.e
    if not e.prefix_caching:
        return CheckResult("prefix_cache", "SKIP", "prefix caching is off in this configuration")
    bs, plen, k = e.block_size, 300, 320
    prompt = run.prompt(plen)
    first = e.llm.generate([prompt], compressed(k, run.seed + 30), use_tqdm=False)[0]
    again = e.llm.generate([prompt], compressed(k, run.seed + 30), use_tqdm=False)[0]
    spec = EvictionSpec(budget=k, buffer=BUFFER, policy="random")
    cache_cap, read_cap = prefix_cache_caps(spec, plen, bs)
    expect_again = min(read_cap, (plen - 1) // bs * bs)
    cont = {"prompt_token_ids": prompt["prompt_token_ids"] + list(first.outputs[0].token_ids[:150])}
    cont_spec = EvictionSpec(budget=480, buffer=BUFFER, policy="random")
    expect_cont = min(cache_cap, prefix_cache_caps(cont_spec, plen + 150, bs)[1])
    follow = e.llm.generate([cont], compressed(480, run.seed + 31), use_tqdm=False)[0]
    err, _ = run.compare(follow, e.records(follow.request_id), control=False)
    details = {"prompt_tokens": plen, "block_size": bs, "first_read": first.num_cached_tokens,
               "again_read": again.num_cached_tokens, "again_expected": expect_again,
               "continuation_read": follow.num_cached_tokens, "continuation_expected": expect_cont,
               "continuation_max_error": err}
    bad = []
    if first.num_cached_tokens != 0:
        bad.append(f"a fresh prompt read {first.num_cached_tokens} cached tokens")
    if again.num_cached_tokens != expect_again:
        bad.append(f"the same prompt again read {again.num_cached_tokens} tokens, expected {expect_again} "
                   "(the protected prompt's whole blocks)")
    elif again.outputs[0].token_ids != first.outputs[0].token_ids:
        bad.append("the same prompt and seed gave other tokens with cached blocks")
    if follow.num_cached_tokens != expect_cont:
        bad.append(f"a continuation read {follow.num_cached_tokens} tokens, expected {expect_cont} (only blocks "
                   "no round rewrote)")
    if not err < e.tolerance:
        bad.append(f"the continuation's max |engine - masked reference| {err:.4f} >= {e.tolerance}")
    figure = (f"same prompt read {again.num_cached_tokens} of {plen} tokens (protected whole blocks {expect_again}); "
              f"a continuation read {follow.num_cached_tokens} (expected {expect_cont}), max |engine - masked "
              f"reference| {err:.4f}")
    return CheckResult("prefix_cache", "FAIL" if bad else "PASS", "; ".join(bad + [figure]), details)
