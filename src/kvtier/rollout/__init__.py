"""kvtier's verl 0.9.1 rollout backend: `actor_rollout_ref.rollout.name=kvtier`.

Modules (nothing is imported here; verl and vLLM load only when a module is used):

* `verl_plugin` — importing it registers the backend with verl (replica + worker-side adapter);
  put `VERL_USE_EXTERNAL_MODULES=kvtier.rollout.verl_plugin` in every Ray worker's environment;
* `replica` (`KVTierReplica`), `server` (`KVTierServer`, the Ray actor hosting vLLM 0.31's AsyncLLM with
  kvtier eviction: the request path and life cycle; its other concerns in `weight_sync`, `admission`
  (sleep / wake, abort / resume), `prompt_protection` (`protect`) and `request_stats` (per-sample
  counters)), `adapter` (`KVTierServerAdapter`, verl's `BaseRollout` in the trainer workers),
  `worker_ext` (vLLM worker extension: the engine's eviction counters plus weight loading);
* `settings` — `rollout.custom.kvtier` / `rollout.engine_kwargs.kvtier` -> engine arguments;
* `metrics` — per-sample eviction columns in the output DataProto and their reduction for logging;
* `sample_counters` — a sample's counters over all of its generate calls (multi-turn, resumed partial
  rollouts), added up in kvtier's agent-loop workers;
* `trainer_hooks` — verl's trainer hooks kvtier uses: `KVTierAgentLoopManager`
  (`rollout.agent.agent_loop_manager_class`: validation at `custom.kvtier.val_budget`, eviction metrics in
  the v0 trainer's logged metrics) and the `kvtier_<mode>` v1 trainers (eviction metrics under `use_v1`);
* `verl_config`, `local`, `demo` — composing `src/kvtier/configs/rollout/kvtier_grpo.yaml`, a local Ray
  rollout stack, `kvtier rollout demo`.
"""
