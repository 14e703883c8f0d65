"""`kvtier engine check` (src/kvtier/evaluation/engine_check/): a clean run on this CPU passes from the
command line as a user runs it, and each planted fault fails the check that is there to catch it, by name:
a keep-set shifted by one position (oracle), a compaction skipped in the worker (eviction, oracle), a freed
block not returned to the pool (blocks). The faults are planted in an in-process float32 engine shared by
the module (the leak goes last: its blocks stay lost)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("vllm")

from kvtier.evaluation.engine_check.runner import open_engine, run_checks  # noqa: E402
from kvtier.evaluation.engine_check.target import from_model  # noqa: E402

pytestmark = pytest.mark.engine

KVTIER = [sys.executable, "-m", "kvtier.cli"]


def _by_name(results):
    return {r.name: r for r in results}


def test_clean_check_passes_as_a_user_runs_it(tmp_path):
    """`kvtier engine check --json F` with no other argument: `kvtier serve`'s default config on the tiny
    model; exit 0, every check PASS with its figure, eviction and block figures that could have failed."""
    out = tmp_path / "check.json"
    proc = subprocess.run([*KVTIER, "engine", "check", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failed"] == []
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["allowlist", "eviction", "oracle", "blocks", "preemption", "prefix_cache"]
    assert all(c["status"] == "PASS" for c in checks.values()), checks
    assert report["configuration"]["prefix_caching"] is True and report["configuration"]["device"] == "cpu"
    for r in checks["eviction"]["details"]["requests"]:
        assert r["rounds"] > 0 and r["peak_blocks"] <= r["bound_blocks"] < r["full_attention_blocks"]
    oracle = checks["oracle"]["details"]
    assert all(r["max_error"] < oracle["tolerance"] < 2 * oracle["tolerance"] < r["max_error_unmasked"]
               for r in oracle["requests"])
    assert max(r["max_error_unmasked"] for r in oracle["requests"]) > oracle["control_min"]
    blocks = checks["blocks"]["details"]
    assert blocks["free_while_running"] < blocks["free_before"] == blocks["free_after_abort"] == blocks["free_after_finish"]
    assert all(r["preemptions"] >= 1 for r in checks["preemption"]["details"]["requests"])
    assert "PASS prefix_cache" in proc.stdout and "every check passed" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "--only ['nope']"),
    (["--config", "src/kvtier/configs/local.yaml", "--engine-kwargs", "{}"], "not both"),
    (["--engine-kwargs", "[1]"], "JSON object"),
    (["--config", "src/kvtier/configs/local.yaml", "--engine", "gpu9"], "--engine 'gpu9'"),
])
def test_bad_arguments_are_refused_by_name_before_any_engine(args, message):
    from typer.testing import CliRunner

    from kvtier.cli import app

    result = CliRunner().invoke(app, ["engine", "check", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_an_off_table_configuration_fails_the_allowlist_check_and_serve_check_refuses(tmp_path):
    """A configuration kvtier is not tested in: `allowlist` FAILs naming the setting, the other checks are
    skipped, and `kvtier serve --check` exits 1 naming the check before Ray starts."""
    from kvtier.evaluation.engine_check.runner import run_engine_check

    report = run_engine_check(from_model(None, json.dumps({"kv_sharing_fast_prefill": True})))
    checks = _by_name(report.checks)
    assert report.failed == ["allowlist"] and "kv_sharing_fast_prefill=True" in checks["allowlist"].figure
    assert {r.status for n, r in checks.items() if n != "allowlist"} == {"SKIP"}

    cfg = (tmp_path / "svc.yaml")
    base = open("src/kvtier/configs/local.yaml").read()
    cfg.write_text(base.replace("      enforce_eager: true", "      enforce_eager: true\n      kv_sharing_fast_prefill: true"))
    proc = subprocess.run([*KVTIER, "serve", "--config", str(cfg), "--check"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAIL allowlist" in proc.stdout and "engine check FAILED" in proc.stderr and "allowlist" in proc.stderr
    assert "starting Ray" not in proc.stdout


def test_each_engine_of_a_config_is_checked_in_its_own_process_with_every_option(monkeypatch):
    """A config with two engines: one `kvtier engine check --engine NAME` process each, carrying the options
    given (here the processes are stubbed: each reports that it did not start)."""
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.evaluation.engine_check import cli

    calls = []
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(
        cmd, 3, "", "boom"))
    config = "k8s/overlays/gpu/serve-config.yaml"
    result = CliRunner().invoke(app, ["engine", "check", "--config", config, "--tolerance", "0.01", "--seed", "7",
                                      "--only", "oracle", "--reference-device", "cuda"])
    engines = list(yaml.safe_load(open(config))["applications"][0]["args"]["engines"])
    assert result.exit_code == 1 and len(engines) == 2
    assert [c[c.index("--engine") + 1] for c in calls] == engines
    for c in calls:
        assert {"--tolerance=0.01", "--seed=7", "--only=oracle", "--reference-device=cuda"} <= set(c)
    assert result.output.count("FAIL start") == 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target = from_model(None, json.dumps({"dtype": "float32", "enable_prefix_caching": True, "enforce_eager": True}))
    return open_engine(target, str(tmp_path_factory.mktemp("engine_check") / "keep.jsonl"))


def test_a_keep_set_shifted_by_one_position_fails_the_oracle(engine, monkeypatch):
    """The log says each head kept its trace entries one position later than the cache holds."""
    from kvtier.engine.stats import AuditLog

    write = AuditLog.write

    def shifted(self, **record):
        if "kept" in record:
            p = record["protected"]
            record["kept"] = [[[x + 1 if x >= p else x for x in head] for head in layer] for layer in record["kept"]]
        write(self, **record)

    monkeypatch.setattr(AuditLog, "write", shifted)
    results = _by_name(run_checks(engine, ["eviction", "oracle"]))
    assert results["eviction"].status == "PASS"
    assert results["oracle"].status == "FAIL" and "masked reference" in results["oracle"].figure


def test_a_skipped_compaction_fails_eviction_and_oracle(engine, monkeypatch):
    """The scheduler frees the tail blocks and moves the offsets; the worker copies nothing."""
    from kvtier.engine.worker_side import WorkerEviction

    monkeypatch.setattr(WorkerEviction, "_compact", lambda self, ops: None)
    results = _by_name(run_checks(engine, ["eviction", "oracle"]))
    assert results["eviction"].status == "FAIL" and "no eviction applied" in results["eviction"].figure
    assert results["oracle"].status == "FAIL"


def test_a_freed_block_not_returned_fails_the_blocks_check(engine, monkeypatch):
    """Compaction cuts the tail blocks from the request but keeps the last of them out of the pool."""
    from kvtier.engine import compat

    free_tail = compat.free_tail_blocks

    def leaky(scheduler, req_id, keep_blocks):
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        blocks = manager.req_to_blocks[req_id]
        if len(blocks) > keep_blocks:
            del blocks[-1]          # dropped from the request, never freed
        return free_tail(scheduler, req_id, keep_blocks)

    monkeypatch.setattr(compat, "free_tail_blocks", leaky)
    results = _by_name(run_checks(engine, ["blocks"]))
    assert results["blocks"].status == "FAIL" and "free blocks" in results["blocks"].figure
