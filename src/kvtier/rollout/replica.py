"""`KVTierReplica`: verl's `RolloutReplica` for the kvtier backend (`actor_rollout_ref.rollout.name=kvtier`).

verl's `LLMServerManager` resolves the name through `RolloutReplicaRegistry` (filled by
`kvtier.rollout.verl_plugin`), builds one replica per `tp*dp*pp` devices and calls

* `init_hybrid(worker_group)` when the trainer's workers host the rollout (hybrid engine): the server
  actor is pinned to the node of the replica's first worker and sees the same accelerators;
* `init_standalone()` otherwise: on a cluster with GPUs the base class creates the GPU resource pool
  and the `CheckpointEngineWorker` group; on a CPU-only Ray cluster (no `GPU` resource) the replica
  launches its server directly on the current node, without a worker group (verl's base class
  always asks for GPUs there).

Each replica launches one `KVTierServer` Ray actor named `kvtier_server_<replica>_<node>` — the name
verl's worker-side adapter convention (`f"{rollout.name}_server_{replica}_{node}"`) looks up.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray

import kvtier.rollout.verl_plugin  # noqa: F401
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .learner_replay import check_learner_config
from .server import KVTierServer
from .settings import KVTierRolloutSettings

logger = logging.getLogger("kvtier.rollout")

SERVER_NAME_PREFIX = "kvtier_"


def cluster_has_gpus() -> bool:
    if os.environ.get("VERL_PLATFORM") == "cpu":   # kvtier's CPU platform declares logical GPUs to verl
        return False
    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:
        return False


class KVTierReplica(RolloutReplica):
    def __init__(self, replica_rank, config, model_config, gpus_per_node: int = 8, is_reward_model: bool = False,
                 is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        self.settings = KVTierRolloutSettings.from_rollout_config(self.config)
        if not (is_reward_model or is_teacher_model):   # only the actor's model config says how the learner scores
            check_learner_config(self.settings.learner, getattr(model_config, "model_type", None))
            self.settings.full_attention_samples(int(getattr(self.config, "n", 1) or 1))   # refuses a bad share
        self.server_class = ray.remote(KVTierServer)

    # -- initialisation -----------------------------------------------------------------------------
    async def init_standalone(self):
        if cluster_has_gpus():
            return await super().init_standalone()
        self.rollout_mode = RolloutMode.STANDALONE
        self.workers = []
        await self.launch_servers()

    async def init_colocated(self, resource_pool):
        if cluster_has_gpus():
            return await super().init_colocated(resource_pool)
        self.rollout_mode = RolloutMode.COLOCATED
        self.resource_pool = resource_pool
        self.workers = []
        await self.launch_servers()

    def rollout_worker_use_gpu(self) -> bool:
        return cluster_has_gpus()

    # -- servers ------------------------------------------------------------------------------------
    def server_name(self, node_rank: int = 0) -> str:
        role = "reward_" if self.is_reward_model else ("teacher_" if self.is_teacher_model else "")
        return f"{SERVER_NAME_PREFIX}server_{role}{self.replica_rank}_{node_rank}{self.name_suffix}"

    async def _worker_placement(self) -> tuple[str, str | None]:
        """(node id, visible-device string) for the server: the replica's workers' node and devices."""
        if not self.workers:
            return ray.get_runtime_context().get_node_id(), None
        from verl.utils.device import get_resource_name

        resource = get_resource_name()

        def where(_self):
            ctx = ray.get_runtime_context()
            ids = ctx.get_accelerator_ids().get(resource) or []
            return ctx.get_node_id(), (str(ids[0]) if ids else None)

        infos = await asyncio.gather(*[w.__ray_call__.remote(where) for w in self.workers])
        nodes = {n for n, _ in infos}
        if len(nodes) != 1:
            raise NotImplementedError(f"kvtier rollout replica spans {len(nodes)} nodes; one node per replica only")
        devices = [d for _, d in infos if d is not None]
        return infos[0][0], (",".join(devices) if devices else None)

    async def launch_servers(self):
        if self.nnodes != 1:
            raise NotImplementedError("kvtier rollout replicas run on one node (tp*dp*pp <= gpus_per_node)")
        if self.workers:
            assert len(self.workers) == self.world_size, (
                f"worker number {len(self.workers)} not equal to world size {self.world_size}")
        node_id, devices = await self._worker_placement()
        from verl.plugin.platform import get_platform

        env_vars = {}
        if devices is not None:
            env_vars.update({var: "1" for var in get_platform().ray_noset_envvars()})
            env_vars.update(get_platform().rollout_env_vars())
        num_cpus = self.settings.server_num_cpus
        if num_cpus is None:
            num_cpus = 0
        name = self.server_name(0)
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": env_vars} if env_vars else None,
            name=name,
            num_cpus=num_cpus,
            max_concurrency=self.max_concurrency,
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode.value,
            workers=self.workers,
            replica_rank=self.replica_rank,
            node_rank=0,
            gpus_per_node=self.gpus_per_replica_node,
            nnodes=1,
            cuda_visible_devices=devices,
        )
        self.servers = [server]
        await server.launch_server.remote()
        address, _ = await server.get_server_address.remote()
        self._server_handle = server
        # No HTTP endpoint; the address is the identifier verl's load balancer keys servers by.
        self._server_address = f"{address}/{name}"

    async def sleep(self):
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    async def abort_all_requests(self, reject_request: bool = False):
        results = await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request)
                                         for s in self.servers])
        return {"aborted_count": sum(r.get("aborted_count", 0) for r in results),
                "request_ids": [i for r in results for i in r.get("request_ids", [])], "server_results": results}

    async def resume_generation(self):
        await asyncio.gather(*[s.resume_generation.remote() for s in self.servers])

    async def abort_request(self, request_id: str):
        results = await asyncio.gather(*[s.abort_request.remote(request_id) for s in self.servers])
        return next((r for r in results if r.get("aborted")), {"aborted": False, "request_id": request_id})

    async def eviction_stats(self):
        return await asyncio.gather(*[s.eviction_stats.remote() for s in self.servers])

    async def shutdown(self):
        await asyncio.gather(*[s.shutdown.remote() for s in self.servers])
