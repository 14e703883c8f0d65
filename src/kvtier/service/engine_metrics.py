"""vLLM's engine metrics through Ray, each series tagged with the Serve deployment that produced it.

Ray Serve LLM's `log_engine_metrics=True` installs vLLM's `RayPrometheusStatLogger`, whose series carry
`model_name` (the served model id), `engine` (the data-parallel index) and `ReplicaId` (a replica's random
suffix, not its deployment). Two engine deployments serving one model id (configs/gpu.yaml's `shared` and
`premium`) are then told apart by no label: every vLLM panel and alert merged them. This is vLLM's own
logger with one more tag, `deployment` (`engine-<name>`, the label kvtier's engine metrics carry, see
exporters.py), so dashboards and alerts split vLLM's and kvtier's engine metrics by the same label while
clients keep calling the public model id. app.py turns Ray's logger off (two loggers would register the
same Ray metric twice) and `install` puts this one in its place once the engine is up.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.ray_wrappers import (RayCounterWrapper, RayGaugeWrapper, RayHistogramWrapper,
                                          RayKVConnectorProm, RayPerfMetricsProm, RayPrometheusMetric,
                                          RayPrometheusStatLogger, RaySpecDecodingProm)

TAG = "deployment"


def serve_deployment() -> str:
    """The Serve deployment this process serves ("" outside Serve, like vLLM's ReplicaId)."""
    try:
        from ray import serve

        return serve.get_replica_context().deployment
    except Exception:  # noqa: BLE001 - not a Serve replica
        return ""


class _DeploymentTag(RayPrometheusMetric):
    """vLLM's Ray wrapper with `deployment` after vLLM's own tag keys (its labels and ReplicaId)."""

    @staticmethod
    def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
        return (*RayPrometheusMetric._get_tag_keys(labelnames), TAG)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deployment = serve_deployment()
        self._tags[TAG] = self._deployment

    def _build_tags(self, *labels, **labelskwargs) -> dict[str, str]:
        if labels:  # vLLM passes its label values in the order of its label names (ReplicaId, TAG follow)
            expected = len(self.metric._tag_keys) - 2
            if len(labels) != expected:
                raise ValueError(f"Number of labels must match the number of tag keys. Expected {expected}, "
                                 f"got {len(labels)}")
            labelskwargs.update(zip(self.metric._tag_keys, labels))
        return {**super()._build_tags(**labelskwargs), TAG: self._deployment}


class Gauge(_DeploymentTag, RayGaugeWrapper):
    pass


class Counter(_DeploymentTag, RayCounterWrapper):
    pass


class Histogram(_DeploymentTag, RayHistogramWrapper):
    pass


class _SpecDecoding(RaySpecDecodingProm):
    _counter_cls = Counter


class _KVConnector(RayKVConnectorProm):
    _gauge_cls, _counter_cls, _histogram_cls = Gauge, Counter, Histogram


class _PerfMetrics(RayPerfMetricsProm):
    _counter_cls = Counter


class DeploymentStatLogger(RayPrometheusStatLogger):
    """vLLM's RayPrometheusStatLogger, every series tagged with its Serve deployment."""

    _gauge_cls, _counter_cls, _histogram_cls = Gauge, Counter, Histogram
    _spec_decoding_cls, _kv_connector_cls, _perf_metrics_cls = _SpecDecoding, _KVConnector, _PerfMetrics


def install(manager, vllm_config) -> DeploymentStatLogger:
    """Put a DeploymentStatLogger in place of the Prometheus logger of an engine's StatLoggerManager (vLLM adds
    its prometheus_client one, which Ray does not export, when no Prometheus logger was given)."""
    stat_logger = DeploymentStatLogger(vllm_config, list(manager.engine_indexes))
    manager.stat_loggers[:] = [x for x in manager.stat_loggers if not isinstance(x, PrometheusStatLogger)]
    manager.stat_loggers.append(stat_logger)
    stat_logger.log_engine_initialized()
    return stat_logger
