"""``/metrics``: cluster-wide figures read from Redis at scrape time.

Cache counters (per kind and tenant) and stage latencies are written to Redis by every worker,
so one scrape of the API covers the whole cluster; queue depths are read from the streams.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cachesvc.counters import Event, read_totals, tenants
from workers import stage_metrics
from workers.messages import Stage
from workers.streams import queue_counts


class ClusterCollector(Collector):
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily |
                                  HistogramMetricFamily]:
        families = {event: CounterMetricFamily(
            f"diffcache_cache_{event.value}", f"Cache {event.value.replace('_', ' ')}, "
            "all processes", labels=["kind", "tenant"]) for event in Event}
        for tenant in tenants(self._redis):
            for field, value in read_totals(self._redis, tenant).items():
                kind, _, event = field.partition(".")
                if event in Event.__members__.values():
                    families[Event(event)].add_metric([kind, tenant], value)
        yield from families.values()

        depth = GaugeMetricFamily("diffcache_queue_depth", "Jobs waiting or in progress",
                                  labels=["stage", "priority"])
        for (stage, priority), counts in queue_counts(self._redis).items():
            depth.add_metric([stage.value, priority.value], sum(counts))
        yield depth

        latency = HistogramMetricFamily("diffcache_stage_seconds", "Seconds per stage job",
                                        labels=["stage"])
        for stage in Stage:
            h = stage_metrics.read(self._redis, stage)
            buckets = [("+Inf" if b == float("inf") else str(b), n) for b, n in h.cumulative]
            latency.add_metric([stage.value], buckets, h.total)
        yield latency


def registry_with(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
