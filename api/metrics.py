"""``/metrics``: cluster-wide figures read from Redis at scrape time.

Cache counters (per kind and tenant) and stage latencies are written to Redis by every worker,
so one scrape of the API covers the whole cluster; queue depths, in-flight counts and the oldest
waiting age are read from the streams.
A scrape needs no key, so tenant names are replaced by digests once tenants have keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import xxhash
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cachesvc.counters import Event, read_totals, tenants
from cachesvc.settings import ApiSettings
from cachesvc.supervisor import ChildStatus, read_published
from keys import Priority
from workers.queue.cluster_view import ClusterView, EngineView, WorkerAdapters
from workers.queue.messages import Stage


def hashed_tenant(tenant: str) -> str:
    """A short, stable label for ``tenant`` that does not reveal its name."""
    return "t-" + xxhash.xxh3_64_hexdigest(tenant.encode())[:12]


def tenant_labeller(api: ApiSettings) -> Callable[[str], str]:
    """How ``/metrics`` labels tenants: by name, or by digest (``auto``: once keys are set)."""
    mode = api.metrics_tenant_labels
    if mode == "auto":
        mode = "hashed" if api.authenticated else "plain"
    return hashed_tenant if mode == "hashed" else str


class ClusterCollector(Collector):
    def __init__(self, view: ClusterView, label: Callable[[str], str] = str) -> None:
        self._view = view
        self._redis = view.redis  # the cache counters and supervisors' reports live there too
        self._label = label

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily |
                                  HistogramMetricFamily]:
        families = {event: CounterMetricFamily(
            f"diffcache_cache_{event.value}", f"Cache {event.value.replace('_', ' ')}, "
            "all processes", labels=["kind", "tenant"]) for event in Event}
        step_cache = CounterMetricFamily(
            "diffcache_step_cache_forwards", "Denoiser forwards run under a step-cache "
            "policy: computed in full, or skipped (a hook stood in for part of them)",
            labels=["tenant", "policy", "outcome"])
        # Its lookups, hits and seconds saved are the ``approx`` kind of the cache families.
        steps_reused = CounterMetricFamily(
            "diffcache_approximate_steps_reused", "Denoising steps approximate reuse took "
            "from similar requests' checkpoints instead of computing them",
            labels=["tenant"])
        for tenant in tenants(self._redis):
            totals = read_totals(self._redis, tenant)
            for field, value in totals.items():
                kind, _, event = field.partition(".")
                if event in Event.__members__.values():
                    families[Event(event)].add_metric([kind, self._label(tenant)], value)
            for policy, outcome, forwards in self._view.step_cache(totals):
                step_cache.add_metric([self._label(tenant), policy, outcome], forwards)
            steps_reused.add_metric([self._label(tenant)], self._view.steps_reused(totals))
        yield from families.values()
        yield step_cache
        yield steps_reused

        yield from self._queue_families()

        latency = HistogramMetricFamily("diffcache_stage_seconds", "Seconds per stage job",
                                        labels=["stage", "priority"])
        for stage in Stage:
            for priority in Priority:
                h = self._view.latency(stage, priority)
                buckets = [("+Inf" if b == float("inf") else str(b), n)
                           for b, n in h.cumulative]
                latency.add_metric([stage.value, priority.value], buckets, h.total)
        yield latency
        rescued = CounterMetricFamily(
            "diffcache_requests_rescued", "Requests the watchdog re-queued because no live "
            "worker owned them and no entry would be delivered; 0 in normal operation",
            labels=["stage", "reason"])
        for (stage, reason), count in self._view.rescued().items():
            rescued.add_metric([stage.value, reason.value], count)
        yield rescued
        yield from children_families(read_published(self._redis))
        yield from adapter_families(self._view.adapters())
        yield from engine_families(self._view.engine())
        served = self._view.served()
        if served is not None:
            info = GaugeMetricFamily("diffcache_served_model_info", "The model the workers "
                                     "serve", labels=["family", "name"])
            info.add_metric([served.family, served.name], 1)
            yield info

    def _queue_families(self) -> Iterator[GaugeMetricFamily]:
        """Depth, in-flight count and oldest waiting age per stage and class: the signals an
        autoscaler or an alert on a stuck pool needs."""
        labels = ["stage", "priority"]
        depth = GaugeMetricFamily("diffcache_queue_depth", "Jobs waiting or in progress",
                                  labels=labels)
        in_flight = GaugeMetricFamily("diffcache_queue_in_flight", "Jobs a worker has taken "
                                      "and not yet acknowledged", labels=labels)
        oldest = GaugeMetricFamily("diffcache_queue_oldest_waiting_seconds", "Seconds since "
                                   "the oldest job no worker has taken was added; 0 when none "
                                   "waits", labels=labels)
        for q in self._view.queues(ages=True):
            key = [q.stage.value, q.priority.value]
            depth.add_metric(key, q.waiting + q.in_flight)
            in_flight.add_metric(key, q.in_flight)
            oldest.add_metric(key, q.oldest_waiting_s)
        yield from (depth, in_flight, oldest)


def children_families(children: list[ChildStatus]) -> Iterator[CounterMetricFamily |
                                                                GaugeMetricFamily]:
    """Restarts, liveness and crash loops of every supervised process."""
    restarts = CounterMetricFamily("diffcache_child_restarts", "Times a supervisor restarted "
                                   "a child that exited", labels=["role", "child"])
    up = GaugeMetricFamily("diffcache_child_up", "1 while the child runs",
                           labels=["role", "child"])
    looping = GaugeMetricFamily("diffcache_child_crash_looping", "1 while the child keeps "
                                "exiting soon after each start", labels=["role", "child"])
    for c in children:
        restarts.add_metric([c.role, c.name], c.restarts)
        up.add_metric([c.role, c.name], int(c.alive))
        looping.add_metric([c.role, c.name], int(c.crash_looping))
    yield from (restarts, up, looping)


def adapter_families(workers: list[WorkerAdapters]) -> Iterator[CounterMetricFamily |
                                                                GaugeMetricFamily]:
    """LoRA loads, swaps, load seconds and adapters held, per denoise worker."""
    loads = CounterMetricFamily("diffcache_lora_loads", "LoRA adapters a worker loaded from "
                                "the store", labels=["worker"])
    swaps = CounterMetricFamily("diffcache_lora_swaps", "Times a worker changed the adapters "
                                "it runs with", labels=["worker"])
    seconds = CounterMetricFamily("diffcache_lora_load_seconds", "Seconds spent loading "
                                  "adapters", labels=["worker"])
    held = GaugeMetricFamily("diffcache_lora_held", "Adapters a worker keeps loaded",
                             labels=["worker"])
    for w in workers:
        loads.add_metric([w.consumer], w.loads)
        swaps.add_metric([w.consumer], w.swaps)
        seconds.add_metric([w.consumer], w.load_seconds)
        held.add_metric([w.consumer], len(w.held))
    yield from (loads, swaps, seconds, held)


def engine_families(engine: EngineView) -> Iterator[GaugeMetricFamily |
                                                    HistogramMetricFamily]:
    """Rows per transformer forward and the wait to join, over every denoise engine, and how
    full each worker's engine is."""
    rows = HistogramMetricFamily("diffcache_engine_rows_per_forward", "Rows one transformer "
                                 "forward of a denoise engine took", labels=[])
    counts = engine.rows
    cumulative = [(str(bound), sum(n for r, n in counts.items() if r <= bound))
                  for bound in engine.row_bounds]
    rows.add_metric([], [*cumulative, ("+Inf", sum(counts.values()))],
                    sum(r * n for r, n in counts.items()))
    yield rows
    wait = engine.join_wait
    joins = HistogramMetricFamily("diffcache_engine_join_wait_seconds", "Seconds from a "
                                  "denoise job's arrival to its first step in an engine",
                                  labels=[])
    joins.add_metric([], [("+Inf" if b == float("inf") else str(b), n)
                          for b, n in wait.cumulative], wait.total)
    yield joins
    occupancy = GaugeMetricFamily("diffcache_engine_occupancy", "Runs a denoise worker's "
                                  "engine holds, as a share of its max_batch",
                                  labels=["worker"])
    for o in engine.occupancy:
        occupancy.add_metric([o.worker], o.runs / o.capacity)
    yield occupancy


def registry_with(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
