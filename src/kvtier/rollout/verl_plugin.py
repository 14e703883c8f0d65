"""Registers the `kvtier` rollout backend with verl 0.9.1 — importing this module is the registration.

verl looks backends up by `actor_rollout_ref.rollout.name` in two process-local registries:

* `verl.workers.rollout.replica.RolloutReplicaRegistry` — the replica class (server side), used by
  `LLMServerManager` in the trainer/driver process to launch the rollout servers;
* `verl.workers.rollout.base._ROLLOUT_REGISTRY[(name, "async")]` — the worker-side adapter (a
  `BaseRollout`), used inside the trainer's Ray workers (`engine_workers.ActorRolloutRefWorker`,
  `checkpoint_engine.CheckpointEngineWorker`) to push weights and sleep/wake the servers.

Both are plain dicts filled at import time, so the registration has to run in *every* Ray worker
process that resolves the name. Ways to get it there (any one is enough):

1. `VERL_USE_EXTERNAL_MODULES=kvtier.rollout.verl_plugin` in the environment of every Ray worker:
   verl's `__init__` imports the listed modules (put it in
   `ray_kwargs.ray_init.runtime_env.env_vars`, as `src/kvtier/configs/rollout/kvtier_grpo.yaml` does, and
   export it in the driver's shell);
2. a `verl.plugins` entry point (`kvtier = "kvtier.rollout.verl_plugin"`), which verl's `__init__` loads in
   every process that imports verl (needs the entry point in kvtier's packaging);
3. importing any of `kvtier.rollout.{replica,server,adapter}` — each imports this module first, so a
   process that unpickles one of kvtier's classes is registered too.

It also registers, with verl's `EngineRegistry`, the training engine of learner replay
(`actor_rollout_ref.model.model_type=kvtier_replay`, `kvtier.rollout.learner_replay`) once verl's FSDP engine
module is imported, and the `kvtier_<mode>` v1 trainers (`trainer.v1.trainer_mode=kvtier_sync`,
`kvtier.rollout.trainer_hooks`) once verl's v1 trainer package is, before `TaskRunnerV1` resolves the mode:
so this one module in `VERL_USE_EXTERNAL_MODULES` is all a job names (importing trainer_hooks from verl's
`__init__` would load the agent loop into every process). `register()` is idempotent; the import runs it once.
"""

from __future__ import annotations

BACKEND_NAME = "kvtier"
# By name, as verl's own registry names its adapters: the replica and adapter modules import this one
# (so unpickling them registers the backend), and this one imports neither.
ADAPTER_FQDN = "kvtier.rollout.adapter.KVTierServerAdapter"
REPLICA_FQDN = "kvtier.rollout.replica.KVTierReplica"


def _load_replica():
    import importlib

    module, name = REPLICA_FQDN.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def register(name: str = BACKEND_NAME) -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, _load_replica)
    base._ROLLOUT_REGISTRY[(name, "async")] = ADAPTER_FQDN
    if name == BACKEND_NAME:   # the actor's `model_type=kvtier_replay` engine (kvtier.rollout.learner_replay)
        from .import_hooks import when_imported
        from .learner_replay import install

        install()
        when_imported("verl.trainer.ppo.v1", _register_trainers, ready=lambda m: hasattr(m, "get_trainer_cls"))


def _register_trainers(_module) -> None:
    import importlib

    importlib.import_module("kvtier.rollout.trainer_hooks")   # registers the kvtier_<mode> v1 trainers on import


def is_registered(name: str = BACKEND_NAME) -> bool:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return name in RolloutReplicaRegistry._registry and (name, "async") in base._ROLLOUT_REGISTRY


register()
