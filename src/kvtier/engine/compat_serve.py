"""vLLM private state of the stat loggers an AsyncLLM runs (the Serve engine replica, kvtier.service, and the
rollout benchmark), as named helpers; re-exported by compat.py, which holds every other private access. The
same in vLLM 0.31 and 0.32 (vllm/v1/metrics/ray_wrappers.py and loggers.py' parts used here are unchanged);
surface.PRIVATE_STATE counts what each helper touches.
"""

from __future__ import annotations

import functools


def stat_logger_manager(engine_client):
    """The AsyncLLM's StatLoggerManager (None when stats are off: disable_log_stats)."""
    return getattr(engine_client, "logger_manager", None)


def in_flight_requests(engine_client) -> int | None:
    """Requests the AsyncLLM frontend has sent to its engine core and not seen finish (None if unknown)."""
    processor = getattr(engine_client, "output_processor", None)
    return len(getattr(processor, "request_states", ())) if processor is not None else None


def stat_loggers(manager) -> list:
    """The manager's loggers, in the order it calls them each step; kvtier appends to it in place."""
    return manager.stat_loggers


def replace_prometheus_logger(manager, stat_logger) -> None:
    """`stat_logger` in place of the manager's Prometheus loggers (vLLM adds its prometheus_client one, which
    Ray does not export, when none was given), after the others."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    loggers = stat_loggers(manager)
    loggers[:] = [x for x in loggers if not isinstance(x, PrometheusStatLogger)]
    loggers.append(stat_logger)


def engine_indexes(manager) -> list[int]:
    return list(manager.engine_indexes)


@functools.cache
def ray_stat_logger_tagged(tag: str, value: str):
    """vLLM's RayPrometheusStatLogger with one more tag, `tag` = `value`, on every series, after vLLM's own tag
    keys (its label names, then ReplicaId). vLLM builds each series through the class attributes it names
    (_gauge_cls, _counter_cls, ...), so the tag is added where Ray's metric is declared."""
    from vllm.v1.metrics.ray_wrappers import (RayCounterWrapper, RayGaugeWrapper, RayHistogramWrapper,
                                              RayKVConnectorProm, RayPerfMetricsProm, RayPrometheusMetric,
                                              RayPrometheusStatLogger, RaySpecDecodingProm)

    class Tagged(RayPrometheusMetric):
        @staticmethod
        def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
            return (*RayPrometheusMetric._get_tag_keys(labelnames), tag)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._tags[tag] = value

        def _build_tags(self, *labels, **labelskwargs) -> dict[str, str]:
            if labels:  # vLLM's label values in the order of its label names (ReplicaId and `tag` follow)
                expected = len(self.metric._tag_keys) - 2
                if len(labels) != expected:
                    raise ValueError(f"Number of labels must match the number of tag keys. Expected {expected}, "
                                     f"got {len(labels)}")
                labelskwargs.update(zip(self.metric._tag_keys, labels))
            return {**super()._build_tags(**labelskwargs), tag: value}

    class Gauge(Tagged, RayGaugeWrapper):
        pass

    class Counter(Tagged, RayCounterWrapper):
        pass

    class Histogram(Tagged, RayHistogramWrapper):
        pass

    class SpecDecoding(RaySpecDecodingProm):
        _counter_cls = Counter

    class KVConnector(RayKVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = Gauge, Counter, Histogram

    class PerfMetrics(RayPerfMetricsProm):
        _counter_cls = Counter

    class TaggedRayPrometheusStatLogger(RayPrometheusStatLogger):
        _gauge_cls, _counter_cls, _histogram_cls = Gauge, Counter, Histogram
        _spec_decoding_cls, _kv_connector_cls, _perf_metrics_cls = SpecDecoding, KVConnector, PerfMetrics

    return TaggedRayPrometheusStatLogger
