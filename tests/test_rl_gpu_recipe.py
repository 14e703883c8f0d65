"""docs/rl.md's GPU command, run as written through verl's own config composition and validation
(`kvtier.rollout.verl_config.validate_config`: verl's main_ppo check, the dataclass conversions its workers
make, its run-time batch asserts, transformers' attention check, kvtier's start-up checks). No GPU, Ray or
weights: the model path is a directory with Qwen3-4B's config.json (the shapes the recipe names) and kvtier's
tiny tokenizer. The command before the recipe fails these checks where the review said it would."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
# Qwen/Qwen3-4B's config.json, shapes only (no weights are read)
QWEN3_4B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
                hidden_act="silu", torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
PLACEHOLDERS = {"actor_rollout_ref.model.path", "data.train_files", "data.val_files"}


def docs_command() -> str:
    text = (REPO / "docs" / "rl.md").read_text()
    return re.search(r"A GPU\s+user runs:\s*```bash\n(.*?)```", text, re.S).group(1)


def run_as_written(script: str) -> tuple[list[str], dict[str, str]]:
    """The arguments `python -m verl.trainer.main_ppo` receives when bash runs `script` (its `$(...)`
    evaluated by bash with this venv's python), and the variables the script exports."""
    shim = ('python() { if [ "$1" = -m ] && [ "$2" = verl.trainer.main_ppo ]; then shift 2; printf "%s\\0" "$@" '
            '> "$ARGS_OUT"; else command python "$@"; fi; }\n')
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvtier-recipe-args-{os.getpid()}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "ARGS_OUT": str(out)}
    proc = subprocess.run(["bash", "-ec", shim + script + '\nprintf "%s" "$VERL_USE_EXTERNAL_MODULES"'],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    try:
        args = out.read_text().split("\0")[:-1]
    finally:
        out.unlink(missing_ok=True)
    return args, {"VERL_USE_EXTERNAL_MODULES": proc.stdout}


@pytest.fixture(scope="module")
def qwen3_4b_dir(tmp_path_factory) -> Path:
    from kvtier.models.tiny import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("qwen3-4b-shapes")
    (path / "config.json").write_text(json.dumps(QWEN3_4B))
    build_tiny_tokenizer().save_pretrained(str(path))
    return path


def compose_as_written(args: list[str], model: Path):
    """verl's Hydra config from main_ppo's command-line arguments, the `...` placeholders filled in."""
    from kvtier.rollout.verl_config import CONFIG_DIR, compose_config

    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--"))
    assert Path(flags["config-path"]).resolve() == CONFIG_DIR, flags
    overrides = [a for a in args if not a.startswith("--")]
    assert {o.split("=", 1)[0] for o in overrides if o.endswith("=...")} == PLACEHOLDERS, overrides
    fill = {"actor_rollout_ref.model.path": str(model), "data.train_files": "/data/train.parquet",
            "data.val_files": "/data/val.parquet"}
    overrides = [f"{o[:-4]}={fill[o[:-4]]}" if o.endswith("=...") else o for o in overrides]
    return compose_config(overrides, config_name=flags["config-name"])


@pytest.fixture(scope="module")
def documented(qwen3_4b_dir):
    args, env = run_as_written(docs_command())
    return compose_as_written(args, qwen3_4b_dir), args, env


def test_the_documented_gpu_command_passes_verls_validation(documented):
    from kvtier.rollout.verl_config import GPU_RECIPE, validate_config

    cfg, args, env = documented
    assert f"--config-name={GPU_RECIPE}" in args
    # the plugin the driver imports is the one every Ray worker imports (the recipe's runtime_env)
    assert env["VERL_USE_EXTERNAL_MODULES"] == "kvtier.rollout.verl_plugin" == \
        cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES
    checked = validate_config(cfg)
    assert checked["n_gpus"] == 8 and checked["use_dynamic_bsz"]
    assert checked["response_length"] == 32768 > checked["budget"] == 2048
    assert checked["learner"] == "replay" and checked["model_type"] == "kvtier_replay"
    assert checked["attn_implementation"] == "kvtier_deathtime"
    assert checked["rollout_is"] == "token"
    a = cfg.actor_rollout_ref
    assert a.actor.ppo_micro_batch_size_per_gpu and a.rollout.log_prob_micro_batch_size_per_gpu
    assert a.actor.ppo_max_token_len_per_gpu >= checked["sequence"] <= a.rollout.max_model_len
    assert cfg.trainer.v1.trainer_mode == "kvtier_sync"


def _with(cfg, **updates):
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        for key, value in updates.items():
            OmegaConf.update(out, key.replace("__", "."), value, force_add=True)
    return out


def test_the_command_before_the_recipe_fails_where_the_review_said(qwen3_4b_dir):
    """kvtier_grpo.yaml with the former command's overrides: no micro-batch size (verl's actor check), then
    verl's flash_attention_2, which this environment and the RL image do not install, then a response length
    (verl's 512) below K = 2048. With all three set it passes."""
    from kvtier.rollout.verl_config import GRPO_CONFIG, compose_config, validate_config

    old = compose_config(["trainer.v1.trainer_mode=kvtier_sync", f"actor_rollout_ref.model.path={qwen3_4b_dir}",
                          "data.train_files=/t.parquet", "data.val_files=/v.parquet"], config_name=GRPO_CONFIG)
    with pytest.raises(Exception, match="ppo_micro_batch_size"):
        validate_config(old)
    r = "actor_rollout_ref"
    fixed = _with(old, **{f"{r}.actor.ppo_micro_batch_size_per_gpu": 1, f"{r}.actor.ppo_mini_batch_size": 16,
                          f"{r}.ref.log_prob_micro_batch_size_per_gpu": 1,
                          f"{r}.rollout.log_prob_micro_batch_size_per_gpu": 1})
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="attn_implementation=flash_attention_2 is not usable"):
            validate_config(fixed)
    fixed = _with(fixed, **{f"{r}.model.override_config.attn_implementation": "sdpa"})
    with pytest.raises(ValueError, match="max_response_length=512 is not above .*budget=2048"):
        validate_config(fixed)
    fixed = _with(fixed, **{"data.max_response_length": 4096})
    assert validate_config(fixed)["learner"] == "dense"


def test_the_checks_refuse_what_the_recipe_must_not_drift_into(documented):
    """Each of these would fail on the GPU, later and at greater cost."""
    from kvtier.rollout.learner_replay import ReplayConfigError
    from kvtier.rollout.verl_config import validate_config

    cfg = documented[0]
    r = "actor_rollout_ref"
    cases = [({f"{r}.actor.ppo_max_token_len_per_gpu": 16384}, ValueError, "one whole sequence per micro-batch"),
             ({f"{r}.actor.ulysses_sequence_parallel_size": 2}, ReplayConfigError, "ulysses_sequence_parallel_size"),
             ({f"{r}.rollout.custom.kvtier.learner": "dense"}, ReplayConfigError, "learner=dense"),
             ({f"{r}.model.override_config.attn_implementation": "sdpa"}, ReplayConfigError, "kvtier_deathtime"),
             ({f"{r}.rollout.max_model_len": 65536}, ValueError, "40960 positions"),
             ({"data.max_prompt_length": 4096}, ValueError, "budget|prompt"),
             ({f"{r}.rollout.calculate_log_probs": False}, ValueError, "calculate_log_probs")]
    for updates, error, match in cases:
        with pytest.raises(error, match=match):
            validate_config(_with(cfg, **updates))


def _flat(cfg) -> dict:
    from omegaconf import OmegaConf

    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node
    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


# what the recipe changes in kvtier_grpo.yaml: the [recipe] keys of kvtier_grpo_qwen3_4b_32k.yaml and what verl
# derives from them (the critic, unused by GRPO, and the distillation teacher copy the actor's and data's values).
# The kvtier block, the rollout correction, the KL loss and the workers' plugin must stay equal.
RECIPE_KEYS = re.compile(
    r"data\.|trainer\.|critic\.|distillation\..*_length$|actor_rollout_ref\.(model\.|ref\.|"
    r"actor\.(strategy|ppo_|use_dynamic_bsz|ulysses|entropy_|optim\.lr|fsdp_config\.(strategy|entropy_|ulysses))|"
    r"rollout\.(tensor_model_parallel_size|gpu_memory_utilization|max_model_len|max_num_batched_tokens|log_prob_|"
    r"prompt_length|response_length|trace\.(project|experiment)_name|custom\.kvtier\.learner$))")


def test_the_recipe_is_kvtier_grpo_plus_its_gpu_settings(documented):
    from kvtier.rollout.verl_config import GRPO_CONFIG, compose_config

    cfg = documented[0]
    base = compose_config([f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}",
                           "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"],
                          config_name=GRPO_CONFIG)
    recipe, grpo = _flat(cfg), _flat(base)
    differ = sorted(k for k in recipe.keys() | grpo.keys() if recipe.get(k, "<absent>") != grpo.get(k, "<absent>"))
    assert differ, "the recipe changes nothing"
    assert [k for k in differ if not RECIPE_KEYS.match(k)] == []
    r = "actor_rollout_ref"
    for key in (f"{r}.rollout.custom.kvtier.learner", "data.max_response_length", f"{r}.actor.use_dynamic_bsz",
                f"{r}.model.override_config.attn_implementation"):
        assert key in differ, key


def test_the_rl_image_check_builds_the_recipes_attention():
    """docker/image_check.py (run by the RL image's build) builds a model with the recipe's attention."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("image_check", REPO / "docker" / "image_check.py")
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.recipe_attention() == "kvtier_grpo_qwen3_4b_32k's attention (kvtier_deathtime)"


def test_why_replay_refuses_ulysses(monkeypatch):
    """verl's Ulysses patch replaces transformers' flash-attention forward (where its all-to-all lives) and
    leaves kvtier's replay attention as it was, so under replay each rank would attend within its own sequence
    shard. The refusal names that path. If a verl upgrade wraps other attentions too, this test fails and the
    refusal can be reconsidered."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.integrations import flash_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.models.transformers import monkey_patch

    from kvtier.deathtime import ATTN_NAME, register
    from kvtier.rollout.learner_replay import ReplayConfigError, check_engine_config

    register()
    monkeypatch.setattr(flash_attention, "_flash_attention_forward", flash_attention._flash_attention_forward)
    ours = ALL_ATTENTION_FUNCTIONS[ATTN_NAME]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=1, num_attention_heads=4,
                                                             num_key_value_heads=2, hidden_size=64, head_dim=16,
                                                             intermediate_size=64, vocab_size=128),
                                                 attn_implementation=ATTN_NAME)
    monkeypatch.setattr(monkey_patch, "patch_forward_with_backends", lambda *a, **k: None)
    monkey_patch.apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True)
    assert flash_attention._flash_attention_forward is monkey_patch._ulysses_flash_attention_forward
    assert ALL_ATTENTION_FUNCTIONS[ATTN_NAME] is ours
    model_config = type("M", (), {"override_config": {"attn_implementation": ATTN_NAME}})()
    with pytest.raises(ReplayConfigError, match="_flash_attention_forward.*own sequence shard"):
        check_engine_config(model_config, type("E", (), {"ulysses_sequence_parallel_size": 2})())
