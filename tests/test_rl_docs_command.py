"""docs/rl.md's command for a GPU user, run as written on CPU: its `export` and its `python -m
verl.trainer.main_ppo ...` line through bash, the `...` placeholders filled with the tiny model and the toy
task's files, and the CPU device settings of `kvtier rl smoke` appended (verl's CPU platform module beside the
plugin, FSDP2 on CPU, small shapes): one GRPO step through verl's v1 trainer in kvtier's trainer mode, with
kvtier's eviction metrics in the trainer's logged metrics. Nothing of the smoke's observation hooks is loaded,
so the plugin alone must register `rollout.name=kvtier` and `trainer.v1.trainer_mode=kvtier_sync` in every
process, as on a GPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[1]
CPU_MODULE = "kvtier.rollout.cpu.verl_platform"


def docs_command() -> str:
    text = (REPO / "docs" / "rl.md").read_text()
    return re.search(r"A GPU\s+user runs:\s*```bash\n(.*?)```", text, re.S).group(1)


def test_docs_rl_command_runs_as_written(tmp_path):
    from kvtier.models.tiny import ensure_tiny_model
    from kvtier.rollout.cpu import rl_smoke, toy_task
    from kvtier.rollout.verl_config import CONFIG_DIR, GRPO_CONFIG

    script = docs_command()
    given = set(re.findall(r"(\S+)=\.\.\.", script))           # the placeholders the user fills in
    assert given == {"actor_rollout_ref.model.path", "data.train_files", "data.val_files"}, given
    model = str(ensure_tiny_model())
    train, val = toy_task.write_dataset(tmp_path / "data", 8)
    script = (script.replace("actor_rollout_ref.model.path=...", f"actor_rollout_ref.model.path={model}")
              .replace("data.train_files=...", f"data.train_files={train}").replace("data.val_files=...", f"data.val_files={val}"))
    # CPU device settings: verl's CPU platform module first, in the driver and (through Ray's runtime_env) in
    # every worker, next to what the shipped config names there
    grpo = yaml.safe_load((Path(CONFIG_DIR) / f"{GRPO_CONFIG}.yaml").read_text())
    workers = grpo["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]["VERL_USE_EXTERNAL_MODULES"]
    script = script.replace("export VERL_USE_EXTERNAL_MODULES=", f"export VERL_USE_EXTERNAL_MODULES={CPU_MODULE},")
    metrics = tmp_path / "metrics.jsonl"
    env_vars = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": f"{CPU_MODULE},{workers}",
                "VERL_FILE_LOGGER_PATH": str(metrics), "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
    cpu = rl_smoke.overrides(model=model, train=train, val=val, workdir=tmp_path, steps=1, batch_size=2, n=2,
                             prompt_length=64, response_length=128, budget=32, buffer=16, kv_cache_mb=64, lr=1e-5,
                             env_vars=env_vars, learner="replay")
    # the recipe already sets what the smoke appends with "+" (Hydra's append refuses a key that exists): override
    cpu = ["+" + o if o.startswith("+") and not o.startswith("++") else o for o in cpu]
    named = set(re.findall(r"(?:^|\s)\+*([\w.]+)=", script))
    cpu = [o for o in cpu if o.lstrip("+").split("=", 1)[0] not in named]
    script = script.rstrip() + " \\\n    " + " ".join(shlex.quote(o) for o in cpu) + "\n"
    (tmp_path / "command.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(env_vars, PATH=f"{Path(sys.executable).parent}:{env['PATH']}", HYDRA_FULL_ERROR="1",
               VERL_USE_EXTERNAL_MODULES=f"{CPU_MODULE},kvtier.rollout.verl_plugin")
    proc = subprocess.run(["bash", "-e", str(tmp_path / "command.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1100, start_new_session=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    steps = [json.loads(line)["data"] for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "training/global_step" in s]
    assert steps, "no training step logged"
    data = steps[-1]
    assert data["rollout/kvtier/eviction_events/mean"] > 0, sorted(k for k in data if "kvtier" in k)
    assert data["rollout/kvtier/compressed_fraction"] == 1.0
    # the recipe's replay learner: every sample of the update scored under its own eviction
    from kvtier.rollout.learner_replay import LEARNER_METRICS

    assert data[f"{LEARNER_METRICS}/replayed_share"] == 1.0, sorted(k for k in data if "replay" in k)
