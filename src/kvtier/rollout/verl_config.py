"""Compose verl configs from `src/kvtier/configs/rollout/kvtier_grpo.yaml` (Hydra, as `verl.trainer.main_ppo`
does)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import kvtier

CONFIG_DIR = Path(kvtier.__file__).resolve().parent / "configs" / "rollout"
GRPO_CONFIG = "kvtier_grpo"
AGENT_LOOP_MANAGER = "kvtier.rollout.trainer_hooks.KVTierAgentLoopManager"


def compose_config(overrides: Iterable[str] = (), config_name: str = GRPO_CONFIG):
    """The full verl trainer config (DictConfig) with kvtier's rollout settings and `overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def cpu_rollout_overrides(model_path: str, *, budget: int | None, buffer: int = 64, policy: str = "random",
                          prompt_length: int = 256, response_length: int = 256, n: int = 1,
                          kv_cache_bytes: int = 64 << 20, max_num_seqs: int = 16, num_agent_workers: int = 1,
                          audit_log: str | None = None, temperature: float = 1.0, seed: int | None = None,
                          max_model_len: int | None = None, protect: str | int | None = None,
                          val_budget: str | int | None = None) -> list[str]:
    """Overrides that make the config runnable on one CPU node with a small model (demo, tests). The agent
    loop manager is kvtier's (validation budget, eviction metrics in the trainer's timing)."""
    null = "null"
    r = "actor_rollout_ref.rollout"
    extra = []
    if protect is not None:
        extra.append(f"++{r}.custom.kvtier.protect={protect}")
    if val_budget is not None:
        extra.append(f"++{r}.custom.kvtier.val_budget={val_budget}")
    return extra + [
        f"++{r}.agent.agent_loop_manager_class={AGENT_LOOP_MANAGER}",
        f"actor_rollout_ref.model.path={model_path}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"{r}.nnodes=1",
        f"{r}.n_gpus_per_node=1",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.n={n}",
        f"{r}.temperature={temperature}",
        f"{r}.load_format=auto",          # standalone servers load the checkpoint (hybrid ones get weights synced)
        f"{r}.enforce_eager=true",
        f"++{r}.enable_sleep_mode=false",  # no vLLM sleep mode on CPU (not in verl's yaml: ++)
        f"{r}.free_cache_engine=false",
        f"{r}.max_model_len={max_model_len or prompt_length + response_length}",
        f"{r}.max_num_seqs={max_num_seqs}",
        f"{r}.max_num_batched_tokens={max(2048, prompt_length + response_length)}",
        f"{r}.agent.num_workers={num_agent_workers}",
        f"{r}.custom.kvtier.policy={policy}",
        f"{r}.custom.kvtier.budget={budget if budget is not None else null}",
        f"{r}.custom.kvtier.buffer={buffer}",
        f"{r}.custom.kvtier.seed={seed if seed is not None else null}",
        f"{r}.custom.kvtier.kv_cache_bytes={kv_cache_bytes}",
        f"{r}.custom.kvtier.audit_log={audit_log if audit_log else null}",
    ]
