"""`kvtier eval ...` commands. Heavy imports happen inside the commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from .cli_common import POLICIES_HELP, csv_list as _csv, policy_items

eval_app = typer.Typer(no_args_is_help=True, help="Accuracy under eviction (paper §4.1 protocol), probes, keep-logs.")


def _threads(n: Optional[int]) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


@eval_app.command("run")
def eval_run(
    tasks: List[Path] = typer.Option(..., "--tasks", help="JSONL task file(s): {question, answer[, id]} per line."),
    model: str = typer.Option(..., help="Hugging Face model directory."),
    out: Path = typer.Option(..., help="Output directory (instances.jsonl, summary.json, report.md)."),
    engine: str = typer.Option("reference", help="vllm (compressed vLLM engine) or reference (transformers)."),
    policies: str = typer.Option("random", help=POLICIES_HELP),
    budgets: str = typer.Option("1024", help="Comma-separated per-head budgets K."),
    protect: str = typer.Option("default", help="Comma-separated protection rules: default, on, off."),
    full: bool = typer.Option(True, "--full/--no-full", help="Also run full attention (the ceiling row)."),
    runs: int = typer.Option(1, help="Independently sampled runs per problem (R)."),
    max_tokens: int = typer.Option(32768, "--max-tokens"),
    temperature: float = typer.Option(0.6),
    top_p: float = typer.Option(0.95, "--top-p"),
    buffer: int = typer.Option(64, help="r, the recent buffer and round cadence."),
    seed: int = typer.Option(0),
    family: str = typer.Option("auto", help="Prompt template: auto, qwen3, phi4, deepseek-r1, chatml, plain."),
    system: Optional[str] = typer.Option(None, help="System prompt override."),
    limit: Optional[int] = typer.Option(None, help="First N problems of each task file."),
    reference: str = typer.Option("random", help="Method the significance marks compare against."),
    audit: bool = typer.Option(False, help="Write the keep-set audit log and keep-log statistics."),
    no_text: bool = typer.Option(False, "--no-text", help="Do not store response texts."),
    kv_cache_gb: float = typer.Option(4.0, "--kv-cache-gb", help="vllm: KV cache pool."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="vllm"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="vllm"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="vllm"),
    device: Optional[str] = typer.Option(None, help="reference: cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="reference: float32, bfloat16, ..."),
    max_batch: int = typer.Option(32, "--max-batch", help="reference: sequences decoded together."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """Run a grid of policies x budgets x protection over task files; grade; write tables."""
    from .report import write_reports
    from .runner import EvalConfig, make_grid, read_instances, run_eval
    from .tasks import load_tasks

    _threads(threads)
    problems = [p for t in tasks for p in load_tasks(t, limit=limit)]
    cells = make_grid(policy_items(policies), [int(b) for b in _csv(budgets)], _csv(protect), full=full)
    cfg = EvalConfig(engine=engine, model=model, family=family, system=system, runs=runs, max_tokens=max_tokens,
                     temperature=temperature, top_p=top_p, buffer=buffer, seed=seed, save_text=not no_text,
                     audit=audit, kv_cache_gb=kv_cache_gb, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     engine_kwargs={"enforce_eager": True} if enforce_eager else {}, device=device, dtype=dtype,
                     max_batch=max_batch)
    path = run_eval(problems, cells, cfg, out)
    summary = write_reports(read_instances(path), out, reference=reference)
    if audit:
        _keeplog_report([out / "audit.jsonl"], out, instances=read_instances(path))
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {path}, {out / 'summary.json'}, {out / 'report.md'} ({len(summary['pairwise'])} comparisons)")


@eval_app.command("report")
def eval_report(
    instances: List[Path] = typer.Option(..., "--instances", help="instances.jsonl file(s) (concatenated)."),
    out: Path = typer.Option(..., help="Output directory."),
    reference: str = typer.Option("random"),
    n_boot: int = typer.Option(4000, "--n-boot"),
    alpha: float = typer.Option(0.05),
    seed: int = typer.Option(0),
) -> None:
    """Tables 1/7/8 and every policy-vs-policy comparison from per-instance results."""
    from .report import write_reports
    from .runner import read_instances

    rows = [r for p in instances for r in read_instances(p)]
    write_reports(rows, out, reference=reference, n_boot=n_boot, alpha=alpha, seed=seed)
    typer.echo((out / "report.md").read_text())


def _keeplog_report(audits: list[Path], out: Path, instances: list[dict] | None = None,
                    protected: Optional[int] = None) -> dict:
    from .keeplog import keeplog_stats, plot_survival, read_records

    records = [r for p in audits for r in read_records(p)]
    # Group by the cell of the request when instances are known (req_id -> "method@K=..."), else by policy.
    method_of = {}
    for inst in instances or []:
        method_of[inst["req_id"]] = inst.get("cell", inst.get("policy"))
    groups: dict[str, list[dict]] = {}
    for r in records:
        rid = r["req_id"]
        key = method_of.get(rid) or next((m for k, m in method_of.items() if rid.startswith(f"{k}-")), None)
        key = key or r.get("policy", "unknown")
        groups.setdefault(key, []).append(r)
    stats = {name: keeplog_stats(recs, protected=protected) for name, recs in groups.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "keeplog.json").write_text(json.dumps(stats, indent=2) + "\n")
    try:
        plot_survival(stats, out / "figure4_survival_by_age.png")
    except ImportError:
        pass
    return stats


@eval_app.command("keeplog")
def eval_keeplog(
    audit: List[Path] = typer.Option(..., "--audit", help="Audit log(s) (JSONL keep-sets per request-round)."),
    out: Path = typer.Option(..., help="Output directory (keeplog.json, figure4_survival_by_age.png)."),
    instances: Optional[Path] = typer.Option(None, help="instances.jsonl to label requests by method."),
    protected: Optional[int] = typer.Option(None, help="Never-evicted prefix for the closed form (default: inferred)."),
) -> None:
    """Appendix D: slot coverage, prompt survival, survival by age (Figure 4)."""
    from .runner import read_instances

    stats = _keeplog_report(audit, out, read_instances(instances) if instances else None, protected)
    for name, st in stats.items():
        typer.echo(f"{name}: rounds={st['rounds']} coverage={st['slot_coverage']} "
                   f"prompt union/head={st['prompt_survival_union']}/{st['prompt_survival_per_head']}")


# The options both probes take
Model = Annotated[str, typer.Option()]
OutDir = Annotated[Path, typer.Option()]
Seed = Annotated[int, typer.Option()]
Device = Annotated[Optional[str], typer.Option()]
Dtype = Annotated[Optional[str], typer.Option()]
MaxBatch = Annotated[Optional[int], typer.Option("--max-batch")]
Threads = Annotated[Optional[int], typer.Option()]


def _probe_setup(model: str, device: Optional[str], dtype: Optional[str], threads: Optional[int]):
    """The reference engine and tokenizer a probe runs on."""
    import torch
    from transformers import AutoTokenizer

    from kvtier.reference import ReferenceEngine

    _threads(threads)
    eng = ReferenceEngine(model, device=device, dtype=getattr(torch, dtype) if dtype else None)
    return eng, AutoTokenizer.from_pretrained(model)


def _write_probe(out: Path, name: str, res: dict, table: str) -> None:
    """`<out>/<name>.json` and `<name>.md`; the table is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=list) + "\n")
    (out / f"{name}.md").write_text(table)
    typer.echo(table)


@eval_app.command("probe-fact")
def eval_probe_fact(
    model: Model,
    out: OutDir,
    conditions: str = typer.Option("h0=0;h01=0,1", help="name=sites;... sites: KV heads in every layer ('0,3'), "
                                   "(layer:head) pairs ('1:0,2:3'); two facts: 'name=sites1|sites2'."),
    n: int = typer.Option(16, help="Planted traces."),
    budget: int = typer.Option(1024),
    buffer: int = typer.Option(64),
    distance: int = typer.Option(15, help="Eviction rounds between the fact and the question."),
    two_facts: bool = typer.Option(False, "--two-facts"),
    second_gap: int = typer.Option(256, "--second-gap"),
    filler: Optional[Path] = typer.Option(None, help="Filler text file (default: synthetic reasoning text)."),
    seed: Seed = 0,
    device: Device = None,
    dtype: Dtype = None,
    max_batch: MaxBatch = None,
    threads: Threads = None,
) -> None:
    """Planted-fact probe (§5.2, Appendix B): retrieval and graded recall R per pinned-head condition."""
    from .probes import format_planted, parse_sites, run_planted_fact

    eng, tok = _probe_setup(model, device, dtype, threads)
    conds = {}
    for part in conditions.split(";"):
        if not part.strip():
            continue
        name, sites = part.split("=", 1)
        if "|" in sites:
            s1, s2 = sites.split("|")
            conds[name.strip()] = (parse_sites(s1, eng.num_layers), parse_sites(s2, eng.num_layers))
        else:
            conds[name.strip()] = parse_sites(sites, eng.num_layers)
    res = run_planted_fact(eng, tok, conds, n=n, budget=budget, buffer=buffer, distance=distance,
                           two_facts=two_facts, second_gap=second_gap, seed=seed, max_batch=max_batch,
                           filler_text=filler.read_text() if filler else None)
    res.pop("outputs", None)
    res.pop("instances_detail", None)
    _write_probe(out, "planted_fact", res, format_planted(res))


@eval_app.command("probe-passcode")
def eval_probe_passcode(
    model: Model,
    out: OutDir,
    policies: str = typer.Option("random,snapkv,rkv,vase", help=POLICIES_HELP + " 'full': no eviction."),
    n: int = typer.Option(16),
    budget: int = typer.Option(1024),
    buffer: int = typer.Option(64),
    distance: int = typer.Option(57, help="Eviction rounds between the passcode and the question."),
    filler: Optional[Path] = typer.Option(None),
    seed: Seed = 0,
    device: Device = None,
    dtype: Dtype = None,
    max_batch: MaxBatch = None,
    threads: Threads = None,
) -> None:
    """Passcode probe (§5.3, Table 3): a passcode stated once, `distance` rounds before the question."""
    from kvtier.engine.config import EvictionSpec

    from .policy_spec import parse_policies, variant_name
    from .probes import format_passcode, run_passcode

    specs = {variant_name(name, params): "full" if name == "full" else
             EvictionSpec(policy=name, budget=budget, buffer=buffer, params=params)
             for name, params in parse_policies(policy_items(policies))}
    eng, tok = _probe_setup(model, device, dtype, threads)
    res = run_passcode(eng, tok, specs, n=n, budget=budget, buffer=buffer, distance=distance, seed=seed,
                       max_batch=max_batch, filler_text=filler.read_text() if filler else None)
    _write_probe(out, "passcode", res, format_passcode(res))


@eval_app.command("grade")
def eval_grade(response: str = typer.Argument(..., help="Model response text."),
               gold: str = typer.Argument(..., help="Gold answer.")) -> None:
    """Grade one response by its final \\boxed{} answer (prints JSON)."""
    from dataclasses import asdict

    from .grader import grade, grader_backend

    typer.echo(json.dumps({**asdict(grade(response, gold)), "backend": grader_backend()}))


def register(app: typer.Typer) -> None:
    """Add `kvtier eval` to the `kvtier` CLI."""
    from .reasoner_cli import register as register_reasoner   # kvtier eval reasoner

    register_reasoner(eval_app)
    app.add_typer(eval_app, name="eval")
