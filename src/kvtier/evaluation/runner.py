"""`kvtier eval run`: a task file through an engine for a grid of policies x budgets x protection, R
sampled runs each, graded by the final \\boxed{} answer; one JSON line per (problem, cell, run).

Engines: ``vllm`` (the compressed vLLM engine, kvtier.engine.api) or ``reference`` (the transformers
reference engine of this package, same schedule). Both get the same requests: per (problem, run) one
sampling seed and one eviction seed shared by every cell (common random numbers, so cells are paired by
problem *and* run).

A cell is (policy with its parameters, budget, protection); protection is ``default`` (the policy's own
rule), ``on`` (the prompt is never evicted) or ``off`` (the score alone). ``full`` (no eviction) is the
ceiling row.
A prompt that cannot be protected within the budget is recorded as skipped (``correct: null``) and its
cell is reported as incomplete.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from kvtier.engine.config import EvictionSpec

from .grader import grade, grader_backend
from .policy_spec import parse_policies, variant_name
from .tasks import Problem, build_prompt, detect_family

PROTECTIONS = ("default", "on", "off")


@dataclass(frozen=True)
class Cell:
    policy: str                 # a registered policy name, or "full"
    budget: int | None = None
    protect: str = "default"
    # the policy's parameters (make_policy's keywords, sent as kvtier_params); not hashed: a dict
    params: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.protect not in PROTECTIONS:
            raise ValueError(f"protection must be one of {PROTECTIONS}, got {self.protect!r}")
        if self.policy != "full" and self.budget is None:
            raise ValueError(f"cell {self.policy!r} needs a budget")

    @property
    def method(self) -> str:
        """Row label: the policy with its parameters, and its protection rule."""
        if self.policy == "full":
            return "full"
        return variant_name(self.policy, self.params) + {"default": "", "on": "+prompt", "off": "-prompt"}[self.protect]

    @property
    def label(self) -> str:
        return "full" if self.policy == "full" else f"{self.method}@K={self.budget}"

    def spec(self, buffer: int, seed: int | None) -> EvictionSpec:
        if self.policy == "full":
            return EvictionSpec(budget=None, buffer=buffer)
        prot = {"default": None, "on": True, "off": False}[self.protect]
        return EvictionSpec(policy=self.policy, budget=self.budget, buffer=buffer, protect_prompt=prot, seed=seed,
                            params=self.params)

    def extra_args(self, buffer: int, seed: int | None) -> dict | None:
        """The vLLM request's `SamplingParams.extra_args` (kvtier_params carries the parameters); full: None,
        the engine default (no budget)."""
        spec = self.spec(buffer, seed)
        return spec.to_extra_args() if spec.compressed else None


def make_grid(policies: Sequence[str], budgets: Sequence[int], protections: Sequence[str] = ("default",),
              full: bool = True) -> list[Cell]:
    """policies: names or `name:key=value` items (policy_spec.py), each refused here if it cannot be built."""
    cells = [Cell("full")] if full else []
    specs = parse_policies(policies)
    for b in budgets:
        for p, params in specs:
            if p == "full":
                continue
            for prot in protections:
                cells.append(Cell(p, int(b), prot, params))
    return cells


@dataclass
class EvalConfig:
    engine: str = "reference"            # "vllm" | "reference"
    model: str = ""
    family: str = "auto"
    system: str | None = None
    runs: int = 1
    max_tokens: int = 1024
    temperature: float = 0.6
    top_p: float = 0.95
    buffer: int = 64
    seed: int = 0
    save_text: bool = True
    audit: bool = False                  # write the keep-set audit log (out/audit.jsonl)
    # vllm
    kv_cache_gb: float = 4.0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    engine_kwargs: dict = field(default_factory=dict)
    # reference
    device: str | None = None
    dtype: str | None = None
    max_batch: int = 32


def request_seed(base: int, problem_index: int, run: int) -> int:
    """One seed per (problem, run), shared by every cell (paired sampling and eviction draws)."""
    return (base * 1_000_003 + problem_index * 9_973 + run * 101 + 17) % (2**31 - 1)


def _check_fits(cell: Cell, prompt_len: int, buffer: int) -> str | None:
    if cell.policy == "full":
        return None
    from kvtier.policies import PolicyError

    try:
        cell.spec(buffer, None).make_policy().check_budget(cell.budget, prompt_len)
    except PolicyError as exc:
        return str(exc)
    return None


def _plan(problems: Sequence[Problem], cells: Sequence[Cell], cfg: EvalConfig, tokenizer, family: str):
    prompts = [build_prompt(tokenizer, p.question, family, system=cfg.system) for p in problems]
    jobs, skipped = [], []
    for pi, (prob, ids) in enumerate(zip(problems, prompts)):
        for cell in cells:
            why = _check_fits(cell, len(ids), cfg.buffer)
            for run in range(cfg.runs):
                seed = request_seed(cfg.seed, pi, run)
                job = dict(problem=prob, cell=cell, run=run, seed=seed, prompt_ids=ids,
                           req_id=f"{prob.task}/{prob.pid}/{cell.label}/r{run}")
                (skipped if why else jobs).append((job, why))
    return jobs, skipped


def _record(job: dict, cfg: EvalConfig, tokenizer, token_ids: Sequence[int], finish: str, rounds: int | None,
            req_id: str) -> dict:
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    g = grade(text, job["problem"].answer)
    cell: Cell = job["cell"]
    rec = {
        "task": job["problem"].task, "pid": job["problem"].pid, "run": job["run"], "cell": cell.label,
        "method": cell.method, "policy": cell.policy, "params": cell.params, "budget": cell.budget,
        "protect": cell.protect, "engine": cfg.engine, "seed": job["seed"], "prompt_tokens": len(job["prompt_ids"]),
        "generated_tokens": len(token_ids), "finish_reason": finish, "rounds": rounds,
        "gold": job["problem"].answer, "extracted": g.extracted, "correct": g.correct, "grade_method": g.method,
        "req_id": req_id,
    }
    if cfg.save_text:
        rec["response"] = text
    return rec


def _skip_record(job: dict, why: str, cfg: EvalConfig) -> dict:
    cell: Cell = job["cell"]
    return {"task": job["problem"].task, "pid": job["problem"].pid, "run": job["run"], "cell": cell.label,
            "method": cell.method, "policy": cell.policy, "params": cell.params, "budget": cell.budget,
            "protect": cell.protect, "engine": cfg.engine, "seed": job["seed"], "prompt_tokens": len(job["prompt_ids"]),
            "generated_tokens": 0, "correct": None, "skipped": why, "gold": job["problem"].answer,
            "req_id": job["req_id"]}


def _run_vllm(jobs, cfg: EvalConfig, llm, tokenizer, audit_path: str | None) -> list[dict]:
    from vllm import SamplingParams

    if llm is None:
        from kvtier.engine.api import build_llm

        kw = dict(cfg.engine_kwargs)
        if cfg.max_model_len:
            kw.setdefault("max_model_len", cfg.max_model_len)
        kw.setdefault("max_num_seqs", cfg.max_num_seqs)
        llm = build_llm(cfg.model, eviction={"default": {"buffer": cfg.buffer}, "audit_log": audit_path},
                        kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)), **kw)
    prompts, params = [], []
    for job, _ in jobs:
        params.append(SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                     top_p=cfg.top_p if cfg.temperature > 0 else 1.0, seed=job["seed"],
                                     extra_args=job["cell"].extra_args(cfg.buffer, job["seed"])))
        prompts.append({"prompt_token_ids": job["prompt_ids"]})
    outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
    rounds = {}
    try:
        from kvtier.engine.api import eviction_stats

        reqs = eviction_stats(llm)["requests"]
        for o in outs:
            for k, v in reqs.items():
                if k == o.request_id or k.startswith(f"{o.request_id}-"):
                    rounds[o.request_id] = v["events"]
    except Exception:
        pass
    recs = []
    for (job, _), o in zip(jobs, outs):
        c = o.outputs[0]
        recs.append(_record(job, cfg, tokenizer, c.token_ids, c.finish_reason or "", rounds.get(o.request_id, 0),
                            o.request_id))
    return recs


def _run_reference(jobs, cfg: EvalConfig, engine, tokenizer, audit_path: str | None) -> list[dict]:
    from kvtier.reference import ReferenceEngine, Request

    if engine is None:
        import torch

        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        engine = ReferenceEngine(cfg.model, device=cfg.device, dtype=dtype)
    reqs = [Request(job["prompt_ids"], job["cell"].spec(cfg.buffer, job["seed"]), max_new_tokens=cfg.max_tokens,
                    temperature=cfg.temperature, top_p=cfg.top_p, seed=job["seed"], req_id=job["req_id"])
            for job, _ in jobs]
    outs = engine.generate(reqs, audit_log=audit_path, keep_records=False, max_batch=cfg.max_batch)
    return [_record(job, cfg, tokenizer, o.token_ids, o.finish_reason, o.rounds, o.req_id)
            for (job, _), o in zip(jobs, outs)]


def run_eval(problems: Sequence[Problem], cells: Sequence[Cell], cfg: EvalConfig, out_dir: str | Path, *,
             llm=None, ref_engine=None, tokenizer=None) -> Path:
    """Generate, grade, write out_dir/instances.jsonl (+ audit.jsonl with cfg.audit) and config.json.
    Returns the instances path. `llm` / `ref_engine` reuse a live engine."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    family = detect_family(cfg.model, tokenizer) if cfg.family == "auto" else cfg.family
    jobs, skipped = _plan(problems, cells, cfg, tokenizer, family)
    audit_path = str(out_dir / "audit.jsonl") if cfg.audit else None
    if audit_path and cfg.engine == "reference":
        Path(audit_path).unlink(missing_ok=True)
    t0 = time.time()
    if cfg.engine == "vllm":
        recs = _run_vllm(jobs, cfg, llm, tokenizer, audit_path)
    elif cfg.engine == "reference":
        recs = _run_reference(jobs, cfg, ref_engine, tokenizer, audit_path)
    else:
        raise ValueError(f"engine must be 'vllm' or 'reference', got {cfg.engine!r}")
    elapsed = time.time() - t0
    recs += [_skip_record(job, why, cfg) for job, why in skipped]
    path = out_dir / "instances.jsonl"
    with open(path, "w") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
    meta = {"config": {k: v for k, v in asdict(cfg).items()}, "family": family, "grader": grader_backend(),
            "cells": [asdict(c) | {"label": c.label, "method": c.method} for c in cells],
            "problems": len(problems), "instances": len(recs), "skipped": len(skipped),
            "generate_seconds": round(elapsed, 2),
            "generated_tokens": sum(r.get("generated_tokens", 0) for r in recs)}
    (out_dir / "config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path


def read_instances(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(l) for l in fh if l.strip()]
