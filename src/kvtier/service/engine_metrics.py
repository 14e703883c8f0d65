"""vLLM's engine metrics through Ray, each series tagged with the Serve deployment that produced it.

Ray Serve LLM's `log_engine_metrics=True` installs vLLM's `RayPrometheusStatLogger`, whose series carry
`model_name` (the served model id), `engine` (the data-parallel index) and `ReplicaId` (a replica's random
suffix, not its deployment). Two engine deployments serving one model id (configs/gpu.yaml's `shared` and
`premium`) are then told apart by no label: every vLLM panel and alert merged them. This is vLLM's own
logger with one more tag, `deployment` (`engine-<name>`, the label kvtier's engine metrics carry, see
exporters.py), so dashboards and alerts split vLLM's and kvtier's engine metrics by the same label while
clients keep calling the public model id (the subclass, which reaches into vLLM's metric wrappers, is
`kvtier.engine.compat.ray_stat_logger_tagged`). app.py turns Ray's logger off (two loggers would register the
same Ray metric twice) and `install` puts this one in its place once the engine is up.
"""

from __future__ import annotations

from kvtier.engine import compat

TAG = "deployment"


def serve_deployment() -> str:
    """The Serve deployment this process serves ("" outside Serve, like vLLM's ReplicaId)."""
    try:
        from ray import serve

        return serve.get_replica_context().deployment
    except Exception:  # noqa: BLE001 - not a Serve replica
        return ""


def stat_logger(vllm_config, engine_indexes: list[int]):
    """vLLM's RayPrometheusStatLogger, every series tagged with this process's Serve deployment."""
    return compat.ray_stat_logger_tagged(TAG, serve_deployment())(vllm_config, engine_indexes)


def install(manager, vllm_config):
    """Put a deployment-tagged stat logger in place of the Prometheus logger of an engine's StatLoggerManager."""
    logger = stat_logger(vllm_config, compat.engine_indexes(manager))
    compat.replace_prometheus_logger(manager, logger)
    logger.log_engine_initialized()
    return logger
