"""Building the Ray Serve application from a ServiceConfig: one LLMServer deployment per engine (Ray
Serve LLM, compressed vLLM engine) and the router ingress bound to their handles."""

from __future__ import annotations

from typing import Any

from kvtier.engine.patches import SHM_SPIN_ENV
from kvtier.engine.worker_ext import QUALNAME as WORKER_EXTENSION

from .config import REASONER_MODELS, TINY_MODEL, EngineConfig, ServiceConfig

ENGINE_ENV = {"TOKENIZERS_PARALLELISM": "false"}
# Only for a Ray cluster kvtier starts itself (launch.py): token auth stays on for shared clusters (KubeRay).
LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
ROUTER_DEPLOYMENT = "KVTierRouter"   # the router deployment's name (its replicas' process titles)
# A stopping replica waits this long before it first counts its requests in flight, and between counts (Serve's
# graceful_shutdown_wait_loop_s, 2 s by default: an idle service then took ~6 s to stop, the router's drain
# and the engines' one after the other). Serve's graceful_shutdown_timeout_s still bounds a drain.
DRAIN_CHECK_S = 0.2


def deployment_name(engine: str) -> str:
    return f"engine-{engine}"


def resolve_model_path(model: str) -> str:
    if model == TINY_MODEL:
        from kvtier.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    if model in REASONER_MODELS:
        from kvtier.models.reasoner import SHIPPED

        return str(SHIPPED[model])
    return model


def vllm_engine_kwargs(eng: EngineConfig, vllm_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The vLLM engine arguments (model aside) one engine deployment runs with, kvtier's config attached;
    vllm_kwargs: eng.engine_kwargs resolved (sizing.py). `kvtier engine check --config` checks these."""
    from kvtier.engine.api import engine_kwargs

    return engine_kwargs(eviction=eng.eviction, kv_cache_bytes=eng.kv_cache_bytes, max_model_len=eng.max_model_len,
                         enable_prefix_caching=eng.enable_prefix_caching, worker_extension_cls=WORKER_EXTENSION,
                         **(eng.engine_kwargs if vllm_kwargs is None else vllm_kwargs))


def llm_config(name: str, eng: EngineConfig, model_id: str, model_path: str, local_ray: bool = False,
               vllm_kwargs: dict[str, Any] | None = None, stream_interval_ms: float = 200,
               serving_nice: int | None = None, model_wait_s: float = 0, model_ready_file: str = "config.json"):
    """Ray Serve LLM's config of one engine; vllm_kwargs: eng.engine_kwargs resolved (sizing.py);
    serving_nice: on a local Ray, the replica lowers its own priority once its engine is up (cpu_priority.py);
    model_wait_s / model_ready_file: how long the replica waits for its model's files (engine_upkeep.py)."""
    from ray.serve.llm import LLMConfig

    kwargs = vllm_engine_kwargs(eng, vllm_kwargs)
    from .cpu_priority import NICE_ENV

    local = {**LOCAL_RAY_ENV, **({NICE_ENV: str(serving_nice)} if serving_nice else {})} if local_ray else {}
    spin = {SHM_SPIN_ENV: str(eng.shm_spin_s)} if eng.shm_spin_s is not None else {}
    env = {**ENGINE_ENV, **local, **spin, **eng.runtime_env.get("env_vars", {})}
    extra: dict[str, Any] = {}
    if eng.accelerator == "cpu":
        extra["accelerator_config"] = {"kind": "cpu"}
    elif eng.accelerator_type:
        extra["accelerator_type"] = eng.accelerator_type
    deployment = dict(eng.deployment)
    # The router polls kvtier_load every second: keep those calls out of the replica's access log.
    deployment.setdefault("logging_config", {"enable_access_log": False})
    deployment.setdefault("graceful_shutdown_wait_loop_s", DRAIN_CHECK_S)
    # Generations go to the replica with the most free KV blocks (replica_router.py), which each replica
    # reports every second through Serve's routing stats
    deployment.setdefault("request_router_config", {
        "request_router_class": "kvtier.service.replica_router:MostFreeKVRouter",
        "request_routing_stats_period_s": 1.0, "request_routing_stats_timeout_s": 5.0})
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_path},
        engine_kwargs=kwargs,
        deployment_config=deployment,
        callback_config={"callback_class": "kvtier.service.engine_server.LocalModelCallback"},
        runtime_env={**eng.runtime_env, "env_vars": env},
        # vLLM's metrics go through Ray all the same, tagged with the deployment: engine_metrics.py installs the
        # logger (Ray's own would register the same metrics without that tag)
        log_engine_metrics=False,
        # kvtier coalesces stream chunks itself (first chunk at once, engine_server.coalesce); Ray Serve
        # LLM's own batcher would hold the first chunk for a whole interval
        experimental_configs={"stream_batching_interval_ms": 0, "kvtier_stream_interval_ms": stream_interval_ms,
                              "kvtier_model_wait_s": model_wait_s, "kvtier_model_ready_file": model_ready_file},
        **extra,
    )


def build_app(args: dict[str, Any]):
    """Ray Serve application builder (`import_path: kvtier.service.app:build_app`, e.g. KubeRay's
    serveConfigV2): `args` is a service config, validated by the same model `kvtier serve` uses."""
    from .config import parse_config

    return build_application(parse_config(args, "serveConfigV2"))[0]


def build_application(cfg: ServiceConfig, local_ray: bool = False):
    """The Serve application (router ingress + engine deployments) and the resolved model paths."""
    from ray.serve.llm import build_llm_deployment

    from .engine_server import KVTierLLMServer
    from .router import KVTierRouter
    from .sizing import resolved_engine_kwargs

    model_paths = {name: resolve_model_path(eng.model) for name, eng in cfg.engines.items()}
    engines = {
        name: build_llm_deployment(llm_config(name, eng, cfg.model_id(name), model_paths[name], local_ray,
                                              resolved_engine_kwargs(cfg, name, model_paths[name])[0],
                                              cfg.server.stream_interval_ms, cfg.server.serving_nice,
                                              cfg.server.model_wait_s, cfg.server.model_ready_file),
                                   deployment_cls=KVTierLLMServer,
                                   override_serve_options={"name": deployment_name(name)})
        for name, eng in cfg.engines.items()
    }
    # the router replicas go where server.router_resources is offered (KubeRay: the router group, which mounts
    # the API keys and the model files the tokenizer is read from); otherwise anywhere
    placement = ({"ray_actor_options": {"num_cpus": 0, "resources": dict(cfg.server.router_resources)}}
                 if cfg.server.router_resources else {})
    router = KVTierRouter.options(name=ROUTER_DEPLOYMENT, num_replicas=cfg.server.router_replicas,
                                  graceful_shutdown_wait_loop_s=DRAIN_CHECK_S, **placement)
    return router.bind(cfg.model_dump(mode="json"), engines, model_paths), model_paths
