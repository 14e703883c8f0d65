"""`kvtier engine check`: the engine's exactness and memory checks on this machine, with the configuration
that will serve; `kvtier serve --check` runs it per engine before Ray starts (`check_service`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

EXIT_FAILED = 1
EXIT_USAGE = 2


def register(engine_app: typer.Typer) -> None:
    @engine_app.command("check")
    def check(
        config: Optional[Path] = typer.Option(None, "--config", "-c", help="Service YAML (kvtier's, or a Ray Serve "
                                              "config running kvtier.service.app:build_app): check each engine's "
                                              "configuration."),
        engine: Optional[str] = typer.Option(None, "--engine", help="Only this engine of --config."),
        model: Optional[str] = typer.Option(None, "--model", help="Model directory to check with (default: the "
                                            "shipped tiny model; give the served model to check it too)."),
        engine_kwargs: Optional[str] = typer.Option(None, "--engine-kwargs", help="vLLM engine arguments as JSON "
                                                    "(without --config; additional_config.kvtier for kvtier's)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the report as JSON to this file ('-': "
                                               "standard output)."),
        only: Optional[List[str]] = typer.Option(None, "--only", help="Run only these checks (repeatable)."),
        reference_device: str = typer.Option("cpu", help="Device of the float32 masked reference."),
        tolerance: Optional[float] = typer.Option(None, help="Max |engine - reference| log-prob error (default: "
                                                  "by dtype, bf16/fp16 0.06, fp32 0.002)."),
        seed: Optional[int] = typer.Option(None, help="Seed of the check's prompts and draws (default: random)."),
    ) -> None:
        """Check the compressed engine on this machine before it serves: the configuration on the tested table,
        eviction happened within its block bound, log-probs equal the masked-attention reference (with an
        unmasked control), blocks return after finish and abort, a forced preemption recomputes exactly, and
        with prefix caching a repeated prompt reads only protected blocks. PASS/FAIL per check; exit 1 on any
        FAIL."""
        from .runner import ALL
        from .target import from_model, from_service_config

        if config is not None and engine_kwargs is not None:
            _usage("give --config or --engine-kwargs, not both")
        if engine is not None and config is None:
            _usage("--engine needs --config")
        if bad := sorted(set(only or ()) - set(ALL)):
            _usage(f"--only {bad}: the checks are {ALL}")
        if config is None and engine_kwargs is None and model is None:
            from kvtier.service.config import DEFAULT_CONFIG

            config = DEFAULT_CONFIG    # what `kvtier serve` serves by default
        try:
            targets = (from_service_config(config, engine, model) if config is not None
                       else [from_model(model, engine_kwargs)])
        except (OSError, ValueError) as exc:
            _usage(str(exc))
        if len(targets) > 1:   # one engine per process: vLLM's in-process engines share global state
            options = _options(only=only, reference_device=reference_device, tolerance=tolerance, seed=seed)
            reports = [run_in_subprocess(config, t.engine, model, options) for t in targets]
        else:
            from .runner import run_engine_check

            reports = [run_engine_check(targets[0], only=only, reference_device=reference_device,
                                        tolerance=tolerance, seed=seed).to_json()]
        for r in reports:
            for line in report_lines(r):
                typer.echo(line)
        if json_out is not None:
            text = json.dumps(reports[0] if len(reports) == 1 else {"ok": all(r["ok"] for r in reports),
                                                                   "engines": reports}, indent=1)
            sys.stdout.write(text + "\n") if json_out == "-" else Path(json_out).write_text(text + "\n")
        if not all(r["ok"] for r in reports):
            raise typer.Exit(EXIT_FAILED)


def _usage(message: str):
    typer.echo(f"kvtier engine check: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _options(*, only: list[str] | None = None, reference_device: str = "cpu", tolerance: float | None = None,
             seed: int | None = None) -> list[str]:
    """The command-line options that reach each engine's process."""
    out = [f"--reference-device={reference_device}"]
    out += [f"--tolerance={tolerance}"] if tolerance is not None else []
    out += [f"--seed={seed}"] if seed is not None else []
    return out + [f"--only={name}" for name in only or ()]


def report_lines(report: dict) -> list[str]:
    conf = ", ".join(f"{k} {v}" for k, v in report["configuration"].items())
    out = [f"kvtier engine check: {report['target']}" + (f" ({conf})" if conf else "")]
    out += [f"  {c['status']:<4} {c['name']:<13} {c['figure']}" for c in report["checks"]]
    out.append("  every check passed" if report["ok"] else f"  FAILED: {', '.join(report['failed'])}")
    return out


def run_in_subprocess(config: Path, engine: str, model: str | None, options: list[str]) -> dict:
    """`kvtier engine check --config CONFIG --engine ENGINE [options]` in a fresh process; its JSON report."""
    with tempfile.TemporaryDirectory(prefix="kvtier-check-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "kvtier.cli", "engine", "check", "--config", str(config), "--engine", engine,
               "--json", str(out)]
        cmd += (["--model", model] if model else []) + options
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"target": f"engine {engine} of {config}", "configuration": {}, "ok": False, "failed": ["start"],
                "checks": [{"name": "start", "status": "FAIL", "figure": f"exit {proc.returncode}: {tail[0]}"}]}


def check_service(config: Path, engines: list[str]) -> list[dict]:
    """`kvtier serve --check`: each engine's report, every engine in its own process (GPU memory freed after)."""
    return [run_in_subprocess(config, name, None, _options()) for name in engines]
