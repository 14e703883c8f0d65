"""`kvtier generate`: offline generation on the compressed engine (the quickest way to see it work),
`kvtier calibrate`: a TriAttention calibration file for the engine's requests, and `kvtier engine
supported`: the table of tested configurations (`kvtier engine check`: evaluation/engine_check/cli.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add `kvtier generate`, `kvtier calibrate` and `kvtier engine supported` to the `kvtier` CLI."""
    engine_app = typer.Typer(no_args_is_help=True, help="The compressed engine's tested configurations and "
                             "its checks on this machine.")
    app.add_typer(engine_app, name="engine")
    from kvtier.evaluation.engine_check.cli import register as register_check

    register_check(engine_app)   # kvtier engine check

    @engine_app.command("supported")
    def supported(as_json: bool = typer.Option(False, "--json", help="Rows as JSON instead of a markdown table."),
                  docs: Optional[Path] = typer.Option(None, "--docs", help="Rewrite the table between the allowlist "
                                                      "markers of this markdown file (docs/engine.md).")) -> None:
        """The configurations kvtier eviction is tested in (src/kvtier/engine/allowlist.py): an engine with
        additional_config.kvtier off this table refuses to start, naming each setting."""
        from .allowlist import TESTED, markdown, write_docs

        if docs is not None:
            typer.echo(f"{docs}: {'rewritten' if write_docs(docs) else 'up to date'}")
        elif as_json:
            typer.echo(json.dumps([{"setting": r.setting, "tested": r.tested, "checked_at": r.at} for r in TESTED], indent=1))
        else:
            typer.echo(markdown(), nl=False)

    @app.command("generate")
    def generate(
        prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
        file: Optional[Path] = typer.Option(None, "--file", "-f", help="File with one prompt per line."),
        budget: Optional[int] = typer.Option(256, help="KV budget K per head (omit with --full)."),
        full: bool = typer.Option(False, "--full", help="Full attention (no eviction)."),
        policy: str = typer.Option("random"),
        buffer: int = typer.Option(64),
        max_tokens: int = typer.Option(1024, "--max-tokens"),
        temperature: float = typer.Option(0.0),
        seed: Optional[int] = typer.Option(None),
        model: Optional[str] = typer.Option(None, help="HF model dir (default: the tiny local Qwen3)."),
        kv_bytes: int = typer.Option(64 << 20, "--kv-bytes"),
        audit_log: Optional[str] = typer.Option(None, "--audit-log", help="Write keep-sets per round (JSONL)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
    ) -> None:
        """Generate with eviction on and print text plus the eviction counters of each request."""
        if (prompt is None) == (file is None):
            raise typer.BadParameter("give exactly one of --prompt or --file")
        prompts = [prompt] if prompt is not None else [l for l in file.read_text().splitlines() if l.strip()]
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import SamplingParams

        from kvtier.engine.api import build_llm, eviction_stats, sampling_extra_args
        from kvtier.models.tiny import ensure_tiny_model

        path = model or str(ensure_tiny_model())
        llm = build_llm(path, eviction={"default": {"buffer": buffer}, "audit_log": audit_log}, kv_cache_bytes=kv_bytes,
                        max_model_len=min(4096, max_tokens + 2048), enforce_eager=True)
        extra = None if full else sampling_extra_args(budget=budget, policy=policy, buffer=buffer, seed=seed)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, extra_args=extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = eviction_stats(llm)["requests"]
        for o in outs:
            counters = next((v for k, v in stats.items() if k == o.request_id or k.startswith(f"{o.request_id}-")),
                            {"events": 0, "tokens_evicted": 0, "peak_blocks": None, "preemptions": 0})
            record = {"prompt": o.prompt, "text": o.outputs[0].text, "generated_tokens": len(o.outputs[0].token_ids),
                      "eviction": {"policy": None if full else policy, "budget": None if full else budget,
                                   "buffer": buffer, **counters}}
            if as_json:
                typer.echo(json.dumps(record))
            else:
                typer.echo(f"--- {o.prompt[:60]!r}\n{record['text']}\n[{json.dumps(record['eviction'])}]")

    # The calibration code lives with its policy (kvtier.policies.triattention_calibration); its command is
    # registered here because importing anything in kvtier.policies imports torch, which `kvtier --help`
    # must not pay for.
    @app.command("calibrate")
    def calibrate(
        out: Path = typer.Option(..., "--out", help="Calibration file to write (safetensors)."),
        model: Optional[str] = typer.Option(None, help="HF model dir (default: the tiny local Qwen3)."),
        tokens: int = typer.Option(128, help="Tokens generated per prompt (the sampled decode steps)."),
        prompt: Optional[List[str]] = typer.Option(None, "--prompt", "-p", help="A prompt (repeatable; default: built-in)."),
        prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="File with one prompt per line."),
        temperature: float = typer.Option(0.0, help="0 = greedy."),
        seed: int = typer.Option(0),
        dtype: str = typer.Option("bfloat16", help="Model dtype for the sample (bfloat16 = as served)."),
        device: str = typer.Option("cpu"),
    ) -> None:
        """TriAttention calibration (per layer and KV head) from the model's own decode steps; pass the file
        to requests as kvtier_params={"calibration": OUT}."""
        from kvtier.models.tiny import ensure_tiny_model
        from kvtier.policies.triattention_calibration import run_calibrate

        prompts = list(prompt or [])
        if prompts_file is not None:
            prompts += [l for l in prompts_file.read_text().splitlines() if l.strip()]
        typer.echo(json.dumps(run_calibrate(model or str(ensure_tiny_model()), out, prompts=prompts or None, tokens=tokens,
                                            temperature=temperature, seed=seed, dtype=dtype, device=device), indent=2))
