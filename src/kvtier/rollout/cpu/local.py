"""A local verl rollout stack on the kvtier backend: Ray on this machine, verl's `LLMServerManager`
(which builds `KVTierReplica`s through the registry) and verl's `AgentLoopManager`.

This is the path verl's PPO trainer takes for rollouts (`generate_sequences(DataProto) -> DataProto`),
minus the trainer; `kvtier rollout demo` and tests/test_rollout.py use it.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

PLUGIN_MODULE = "kvtier.rollout.verl_plugin"


def ray_runtime_env() -> dict:
    env = {
        "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE,   # registers rollout.name=kvtier in every Ray worker
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VERL_LOGGING_LEVEL": os.environ.get("VERL_LOGGING_LEVEL", "WARN"),
    }
    return {"env_vars": env}


def init_local_ray(num_cpus: int | None = None, log_to_driver: bool = False,
                   metrics_export_port: int | None = None) -> bool:
    """Start a local Ray (no dashboard, token auth off) unless one is running; True if started here.
    `metrics_export_port`: where Ray serves Prometheus metrics (the rollout dashboard's source)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", PLUGIN_MODULE)
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=log_to_driver,
             runtime_env=ray_runtime_env(), _metrics_export_port=metrics_export_port)
    return True


def chat_batch(prompts: Iterable[str], **meta_info):
    """A verl DataProto of single-turn chat prompts (the `raw_prompt` column verl's RLHFDataset makes)."""
    from verl.protocol import DataProto

    prompts = list(prompts)
    raw = np.empty(len(prompts), dtype=object)
    for i, p in enumerate(prompts):
        raw[i] = [{"role": "user", "content": p}]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": raw, "index": np.arange(len(prompts))})
    batch.meta_info.update(meta_info)
    return batch


class LocalRollout:
    """verl's rollout servers + agent loop for a composed config (rollout.name=kvtier)."""

    def __init__(self, config) -> None:
        import kvtier.rollout.verl_plugin  # noqa: F401
        from verl.experimental.agent_loop.agent_loop import AgentLoopManager
        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.rollout.llm_server import LLMServerManager

        self.config = config
        self.servers = LLMServerManager.create(config)            # -> KVTierReplica.init_standalone()
        # the manager class as verl's trainers pick it (rollout.agent.agent_loop_manager_class)
        fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        manager = load_class_from_fqn(fqn, "AgentLoopManager") if fqn else AgentLoopManager
        # DataProto in, DataProto out: the v0 manager whatever trainer.use_v1 says (kvtier's dispatches on it)
        create = getattr(manager, "create_dataproto", manager.create)
        self.agent = create(config, llm_client=self.servers.get_client())

    @property
    def replicas(self):
        return self.servers.get_replicas()

    @property
    def server(self):
        return self.servers.server_handles[0]

    def generate_sequences(self, batch):
        return self.agent.generate_sequences(batch)

    def close(self) -> None:
        import ray

        for handle in self.servers.server_handles:
            try:
                ray.get(handle.shutdown.remote(), timeout=60)
            except Exception:
                pass


def registration_state(_actor=None) -> dict:
    """Is the kvtier backend registered in this process, and did verl's import hook do it? (Checks
    `sys.modules` before touching kvtier's verl modules; usable with `actor.__ray_call__`.)"""
    import sys

    imported = "kvtier.rollout.verl_plugin" in sys.modules
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return {"plugin_imported": imported, "replica": "kvtier" in RolloutReplicaRegistry._registry,
            "adapter": ("kvtier", "async") in base._ROLLOUT_REGISTRY}
