"""`kvtier eval reasoner`: accuracy of the shipped reasoner under eviction, on the vLLM CPU engine.

Grid: full attention plus ``policies`` x ``budgets``, on held-out problems of both kinds of one task
family (kvtier.tasks.chains: ``chains``, the shipped reasoner's, or ``chains-long``, which needs a model
with >= 4,096 positions; the CLI defaults to the family the model records, kvtier.models.reasoner.models_family), ``runs`` paired seeds per problem (one sampling + eviction seed per
(problem, run), shared by every cell: runner.request_seed; decoding is greedy by default, so the seeds
drive random's eviction draws). Generation, grading by ``\\boxed{}`` and the
per-instance records are the eval runner's (runner._run_vllm / _record); the statistics are report.py's
(paired, problem-clustered bootstrap CI + exact sign test for every pair of methods in a column, a
column being (kind, K)).

Output (``out``): instances.jsonl, summary.json (report.summarize), report.md (Table 1, 7, 8 and every
pairwise comparison), reasoner_eval.json (what the command prints) and accuracy_vs_budget.png.

Printed JSON::

    {"full_accuracy": {"local": .., "needle": ..},
     "cells": [{"policy", "params", "method", "budget", "kind", "accuracy", "ci": [lo, hi], "n",
                "vs_full": {diff, lo, hi, p_sign, significant}}, ...],
     "pairwise": [...], "config": {...}, "seconds": ..}

``policy`` is the registered name, ``params`` its parameters ({} for none) and ``method`` the row both name
(report.md's, e.g. ``random_reserve(reserve=0.1)``; ``--policies`` items: policy_spec.py), so variants of one
policy are separate cells. ``ci`` is the 95% problem-clustered percentile bootstrap interval of the cell's
accuracy.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.tasks import chains as rt
from .runner import Cell, EvalConfig, make_grid, request_seed
from .stats import bootstrap_replicates
from .tasks import Problem

POLICIES = ("random", "snapkv", "rkv", "h2o", "streaming")
BUDGETS = (128, 256, 512)


@dataclass
class ReasonerEvalConfig:
    problems: int = 32                  # held-out problems per kind
    runs: int = 2                       # R paired seeds
    policies: tuple = POLICIES
    budgets: tuple = BUDGETS
    kinds: tuple = rt.KINDS
    buffer: int = 32                    # r: every r decode steps the cache returns from K + r to K
    temperature: float = 0.0             # greedy: the R seeds drive the eviction draws (random)
    top_p: float = 0.95
    max_tokens: int = 0                 # 0: the family's budget (chains: 1200, its longest trace is 1,122 tokens)
    seed: int = 0
    threads: int = 1
    max_num_seqs: int = 256
    kv_cache_mb: int = 0                # 0: the family's (KV_CACHE_MB)
    model: str = ""
    family: str = rt.DEFAULT_FAMILY     # the task family (kvtier.tasks.chains.FAMILIES)
    split: str = "heldout"              # heldout (eval_problems) | selection (selection_problems: choosing settings)
    dtype: str = "auto"                 # engine dtype: auto (float32 on a CPU without native bf16, where vLLM's
                                        # bf16 matmuls are ~70x slower; else the models' bfloat16) | bfloat16 | float32
    engine: str = "vllm"                # vllm | reference (kvtier.reference: transformers, the same keep-sets; GPU boxes without vLLM)
    device: str = ""                    # reference: cuda when there is one, else cpu
    max_batch: int = 0                  # reference: requests decoded together (0: all)

    def __post_init__(self):
        self.max_tokens = self.max_tokens or rt.family(self.family).max_tokens   # ValueError: unknown family
        self.kv_cache_mb = self.kv_cache_mb or KV_CACHE_MB.get(self.family, KV_CACHE_MB[rt.DEFAULT_FAMILY])
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.split not in rt.SPLITS:
            raise ValueError(f"split must be one of {rt.SPLITS}, got {self.split!r}")

    @property
    def max_model_len(self) -> int:
        """bos + prompt + max_tokens, rounded up to 512 (chains: 1536)."""
        return -(-(self.max_tokens + 64) // 512) * 512


DTYPES = ("auto", "bfloat16", "float32")
ENGINES = ("vllm", "reference")
# The evaluation engine's KV pool: room for the grid's requests to run together, not a budget under test
# (accuracy does not depend on it). chains-long at 512 MiB held 32 full 8-KV-head traces in bf16 and preempted
# the rest; 2 GiB ran 32 requests 18% faster here (2026-12-04, a training beside both runs).
KV_CACHE_MB = {"chains": 512, "chains-long": 2048}
QUICK = dict(problems=16, runs=1, policies=("random", "streaming"), budgets=(128, 512))


def engine_dtype(requested: str, log=print, accelerator: str | None = None) -> str:
    """The engine dtype `requested` resolves to on `accelerator` (cpu | cuda; default: this machine's); auto
    says once what it chose where that is not bfloat16."""
    import torch

    from kvtier.engine.cpu_dtype import resolve_dtype

    accelerator = accelerator or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, why = resolve_dtype(requested, accelerator)
    if why:
        log(why)
    return dtype or "bfloat16"


def build_engine(cfg: ReasonerEvalConfig):
    """An in-process compressed vLLM engine on the reasoner (cfg.dtype resolved, eager, prefix caching off)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvtier.engine.api import build_llm

    return build_llm(cfg.model, eviction={"default": {"buffer": cfg.buffer}}, dtype=cfg.dtype,
                     kv_cache_bytes=cfg.kv_cache_mb << 20, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                     enforce_eager=True)


def check_positions(cfg: ReasonerEvalConfig) -> None:
    """ValueError, before any engine starts, when the model has fewer positions than the family's traces
    need (the shipped reasoner has 2,048; chains-long needs 4,096)."""
    from transformers import AutoConfig

    from kvtier.models.reasoner import reasoner_dir

    model = cfg.model or str(reasoner_dir())
    positions = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if positions is not None and positions < cfg.max_model_len:
        raise ValueError(f"task family {cfg.family} needs max_model_len {cfg.max_model_len} (max_tokens "
                         f"{cfg.max_tokens}); {model} has max_position_embeddings {positions}")


def _jobs(cfg: ReasonerEvalConfig, tokenizer, cells: list[Cell]) -> list[tuple[dict, None]]:
    jobs = []
    fam = rt.family(cfg.family)
    draw = fam.selection_problems if cfg.split == "selection" else fam.eval_problems
    for kind in cfg.kinds:
        for pi, cp in enumerate(draw(cfg.problems, kind)):
            prob = Problem(task=kind, pid=f"{kind}-{pi}", question=cp.prompt, answer=cp.answer)
            ids = tokenizer(cp.prompt)["input_ids"]                       # bos + prompt, no template
            for cell in cells:
                for run in range(cfg.runs):
                    seed = request_seed(cfg.seed, pi, run)
                    jobs.append((dict(problem=prob, cell=cell, run=run, seed=seed, prompt_ids=ids,
                                      req_id=f"{kind}/{pi}/{cell.label}/r{run}"), None))
    return jobs


def accuracy_ci(rows: list[dict], n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap of the accuracy, problems resampled (their runs move together)."""
    per = {}
    for r in rows:
        per.setdefault(r["pid"], []).append(1.0 if r["correct"] else 0.0)
    reps = bootstrap_replicates(np.array([np.mean(v) for v in per.values()]), n_boot, seed)
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def summarize_cells(instances: list[dict], summary: dict) -> dict:
    """The printed JSON's `full_accuracy` and `cells` from instances and report.summarize's summary."""
    full, cells = {}, []
    for kind in sorted({r["task"] for r in instances}):
        # keyed by method (report.py's rows), not policy: variants of one policy are separate cells
        for key in sorted({(r["method"], r["budget"]) for r in instances if r["task"] == kind},
                          key=lambda k: (k[0] != "full", k[0], k[1] or 0)):
            rows = [r for r in instances if r["task"] == kind and (r["method"], r["budget"]) == key]
            acc = float(np.mean([1.0 if r["correct"] else 0.0 for r in rows]))
            cell = {"policy": rows[0]["policy"], "params": rows[0].get("params") or {}, "method": key[0],
                    "budget": key[1], "kind": kind, "accuracy": acc,
                    "ci": [round(x, 4) for x in accuracy_ci(rows)], "n": len(rows),
                    "mean_generated_tokens": float(np.mean([r["generated_tokens"] for r in rows]))}
            if key[0] == "full":
                full[kind] = acc
            else:
                col = f"{kind}@K={key[1]}"
                pair = next((p for p in summary["pairwise"] if p["column"] == col and p["a"] == "full"
                             and p["b"] == key[0]), None)
                if pair:   # report the policy minus full
                    cell["vs_full"] = {"diff": 0.0 - pair["diff"], "lo": 0.0 - pair["hi"], "hi": 0.0 - pair["lo"],
                                       "p_sign": pair["p_sign"], "significant": pair["significant"]}
            cells.append(cell)
    return {"full_accuracy": full, "cells": cells}


def run_reasoner_eval(cfg: ReasonerEvalConfig, out: str | Path, *, llm=None) -> dict:
    """Generate, grade, write the reports and the plot; returns the printed JSON's dict."""
    import torch
    from transformers import AutoTokenizer

    from kvtier.models.reasoner import reasoner_dir

    from .report import write_reports
    from .runner import _run_reference, _run_vllm

    torch.set_num_threads(cfg.threads)
    cfg.model = cfg.model or str(reasoner_dir())
    if cfg.engine == "reference":
        cfg.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the result's config records what ran (the reference engine: on its device)
    cfg.dtype = engine_dtype(cfg.dtype, accelerator=torch.device(cfg.device).type if cfg.device else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if llm is None:
        check_positions(cfg)                # before the engine: vLLM's own refusal comes after a model load
    tok = AutoTokenizer.from_pretrained(cfg.model)
    cells = make_grid(cfg.policies, cfg.budgets)
    jobs = _jobs(cfg, tok, cells)
    t0 = time.time()
    ecfg = EvalConfig(engine=cfg.engine, model=cfg.model, runs=cfg.runs, max_tokens=cfg.max_tokens,
                      temperature=cfg.temperature, top_p=cfg.top_p, buffer=cfg.buffer, seed=cfg.seed,
                      device=cfg.device or None, dtype=cfg.dtype, max_batch=cfg.max_batch)
    if cfg.engine == "reference":
        instances = _run_reference(jobs, ecfg, None, tok, None)
    else:
        instances = _run_vllm(jobs, ecfg, llm or build_engine(cfg), tok, None)
    seconds = time.time() - t0
    with open(out / "instances.jsonl", "w") as fh:
        for r in instances:
            fh.write(json.dumps(r) + "\n")
    summary = write_reports(instances, out, reference="full")
    result = summarize_cells(instances, summary)
    result.update(pairwise=summary["pairwise"], seconds=round(seconds, 1),
                  generated_tokens=int(sum(r["generated_tokens"] for r in instances)),
                  config={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()})
    (out / "reasoner_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        from .reasoner_plot import plot_accuracy_vs_budget

        plot_accuracy_vs_budget(result, out / "accuracy_vs_budget.png")
    except ImportError:         # matplotlib missing: the JSON and tables are still written
        pass
    return result


def markdown_table(result: dict) -> str:
    """Accuracy vs budget per kind: rows methods (a policy with its parameters), columns K, with the 95% CI
    (results written before cells had a method: rows by policy)."""
    lines = []
    for kind in sorted(result["full_accuracy"]):
        cells = [c for c in result["cells"] if c["kind"] == kind]
        budgets = sorted({c["budget"] for c in cells if c["budget"] is not None})
        full = next(c for c in cells if c["policy"] == "full")
        lines += [f"**{kind}** (full attention: {full['accuracy']:.3f} [{full['ci'][0]:.2f}, {full['ci'][1]:.2f}])",
                  "", "| policy | " + " | ".join(f"K={b}" for b in budgets) + " |",
                  "| --- |" + " --- |" * len(budgets)]
        for pol in dict.fromkeys(c.get("method", c["policy"]) for c in cells if c["policy"] != "full"):
            row = []
            for b in budgets:
                c = next((c for c in cells if c.get("method", c["policy"]) == pol and c["budget"] == b), None)
                if c is None:
                    row.append("–")
                    continue
                mark = " ▼" if c.get("vs_full", {}).get("significant") and c["vs_full"]["diff"] < 0 else ""
                row.append(f"{c['accuracy']:.3f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]{mark}")
            lines.append(f"| {pol} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)
