"""``/metrics``: cluster-wide figures read from Redis at scrape time.

Cache counters (per kind and tenant) and stage latencies are written to Redis by every worker,
so one scrape of the API covers the whole cluster; queue depths, in-flight counts and the oldest
waiting age are read from the streams.
A scrape needs no key, so tenant names are replaced by digests once tenants have keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cachesvc.counters import Event, read_totals, tenants
from cachesvc.value_index import held
from config.settings import ApiSettings
from keys import Priority
from supervision.supervisor import ChildStatus, read_published
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


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric ``/metrics`` shows: declared here, listed in the documentation's reference
    (``docs/gen_reference.py``), and made into a family at each scrape."""

    name: str
    kind: type[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]
    help: str
    labels: tuple[str, ...] = ()

    def family(self) -> Any:
        return self.kind(self.name, self.help, labels=list(self.labels))


CACHE = {event: Metric(f"diffcache_cache_{event.value}", CounterMetricFamily,
                       f"Cache {event.value.replace('_', ' ')}, all processes",
                       ("kind", "tenant")) for event in Event}
HELD = Metric("diffcache_cache_bytes_held", GaugeMetricFamily,
              "Bytes the cache's recorded entries hold (the value sweeper keeps them below "
              "cache.evict_above of the capacity)", ("kind", "tenant"))
STEP_CACHE = Metric("diffcache_step_cache_forwards", CounterMetricFamily,
                    "Denoiser forwards run under a step-cache policy: computed in full, or "
                    "skipped (a rule stood in for part of them)", ("tenant", "policy", "outcome"))
# Its lookups, hits and seconds saved are the ``approx`` kind of the cache families.
STEPS_REUSED = Metric("diffcache_approximate_steps_reused", CounterMetricFamily,
                      "Denoising steps approximate reuse took from similar requests' "
                      "checkpoints instead of computing them", ("tenant",))
STAGE_SECONDS = Metric("diffcache_stage_seconds", HistogramMetricFamily,
                       "Seconds per stage job", ("stage", "priority"))
RESCUED = Metric("diffcache_requests_rescued", CounterMetricFamily,
                 "Requests the watchdog re-queued because no live worker owned them and no "
                 "entry would be delivered; 0 in normal operation", ("stage", "reason"))
SERVED = Metric("diffcache_served_model_info", GaugeMetricFamily, "The model the workers serve",
                ("family", "name"))
QUEUE = ("stage", "priority")
DEPTH = Metric("diffcache_queue_depth", GaugeMetricFamily, "Jobs waiting or in progress", QUEUE)
IN_FLIGHT = Metric("diffcache_queue_in_flight", GaugeMetricFamily,
                   "Jobs a worker has taken and not yet acknowledged", QUEUE)
OLDEST = Metric("diffcache_queue_oldest_waiting_seconds", GaugeMetricFamily,
                "Seconds since the oldest job no worker has taken was added; 0 when none "
                "waits", QUEUE)
CHILD = ("role", "child")
RESTARTS = Metric("diffcache_child_restarts", CounterMetricFamily,
                  "Times a supervisor restarted a child that exited", CHILD)
UP = Metric("diffcache_child_up", GaugeMetricFamily, "1 while the child runs", CHILD)
LOOPING = Metric("diffcache_child_crash_looping", GaugeMetricFamily,
                 "1 while the child keeps exiting soon after each start", CHILD)
LORA_LOADS = Metric("diffcache_lora_loads", CounterMetricFamily,
                    "LoRA adapters a worker loaded from the store", ("worker",))
LORA_SWAPS = Metric("diffcache_lora_swaps", CounterMetricFamily,
                    "Adapters a worker unloaded to make room for another", ("worker",))
LORA_SECONDS = Metric("diffcache_lora_load_seconds", CounterMetricFamily,
                      "Seconds spent loading adapters", ("worker",))
LORA_HELD = Metric("diffcache_lora_held", GaugeMetricFamily, "Adapters a worker keeps loaded",
                   ("worker",))
ROWS = Metric("diffcache_engine_rows_per_forward", HistogramMetricFamily,
              "Rows one transformer forward of a denoise engine took")
JOIN_WAIT = Metric("diffcache_engine_join_wait_seconds", HistogramMetricFamily,
                   "Seconds from a denoise job's arrival to its first step in an engine")
OCCUPANCY = Metric("diffcache_engine_occupancy", GaugeMetricFamily,
                   "Runs a denoise worker's engine holds, as a share of its max_batch (up to "
                   "workers.ride_along while step caches skip rows)",
                   ("worker",))
# Every metric ``/metrics`` shows, in the order it shows them.
METRICS = (*CACHE.values(), HELD, STEP_CACHE, STEPS_REUSED, DEPTH, IN_FLIGHT, OLDEST, STAGE_SECONDS,
           RESCUED, RESTARTS, UP, LOOPING, LORA_LOADS, LORA_SWAPS, LORA_SECONDS, LORA_HELD,
           ROWS, JOIN_WAIT, OCCUPANCY, SERVED)


class ClusterCollector(Collector):
    def __init__(self, view: ClusterView, label: Callable[[str], str] = str) -> None:
        self._view = view
        self._redis = view.redis  # the cache counters and supervisors' reports live there too
        self._label = label

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily |
                                  HistogramMetricFamily]:
        families = {event: CACHE[event].family() for event in Event}
        step_cache, steps_reused = STEP_CACHE.family(), STEPS_REUSED.family()
        bytes_held = HELD.family()
        for tenant in tenants(self._redis):
            for held_kind, nbytes in held(self._redis, tenant).items():
                bytes_held.add_metric([held_kind.value, self._label(tenant)], nbytes)
            totals = read_totals(self._redis, tenant)
            for field, value in totals.items():
                kind, _, event = field.partition(".")
                if event in Event.__members__.values():
                    families[Event(event)].add_metric([kind, self._label(tenant)], value)
            for policy, outcome, forwards in self._view.step_cache(totals):
                step_cache.add_metric([self._label(tenant), policy, outcome], forwards)
            steps_reused.add_metric([self._label(tenant)], self._view.steps_reused(totals))
        yield from families.values()
        yield bytes_held
        yield step_cache
        yield steps_reused

        yield from self._queue_families()

        latency = STAGE_SECONDS.family()
        for stage in Stage:
            for priority in Priority:
                h = self._view.latency(stage, priority)
                buckets = [("+Inf" if b == float("inf") else str(b), n)
                           for b, n in h.cumulative]
                latency.add_metric([stage.value, priority.value], buckets, h.total)
        yield latency
        rescued = RESCUED.family()
        for (stage, reason), count in self._view.rescued().items():
            rescued.add_metric([stage.value, reason.value], count)
        yield rescued
        yield from children_families(read_published(self._redis))
        yield from adapter_families(self._view.adapters())
        yield from engine_families(self._view.engine())
        served = self._view.served()
        info = SERVED.family()
        if served is not None:
            info.add_metric([served.family, served.name], 1)
        yield info

    def _queue_families(self) -> Iterator[GaugeMetricFamily]:
        """Depth, in-flight count and oldest waiting age per stage and class: the signals an
        autoscaler or an alert on a stuck pool needs."""
        depth, in_flight, oldest = DEPTH.family(), IN_FLIGHT.family(), OLDEST.family()
        for q in self._view.queues(ages=True):
            key = [q.stage.value, q.priority.value]
            depth.add_metric(key, q.waiting + q.in_flight)
            in_flight.add_metric(key, q.in_flight)
            oldest.add_metric(key, q.oldest_waiting_s)
        yield from (depth, in_flight, oldest)


def children_families(children: list[ChildStatus]) -> Iterator[CounterMetricFamily |
                                                                GaugeMetricFamily]:
    """Restarts, liveness and crash loops of every supervised process."""
    restarts, up, looping = RESTARTS.family(), UP.family(), LOOPING.family()
    for c in children:
        restarts.add_metric([c.role, c.name], c.restarts)
        up.add_metric([c.role, c.name], int(c.alive))
        looping.add_metric([c.role, c.name], int(c.crash_looping))
    yield from (restarts, up, looping)


def adapter_families(workers: list[WorkerAdapters]) -> Iterator[CounterMetricFamily |
                                                                GaugeMetricFamily]:
    """LoRA loads, swaps, load seconds and adapters held, per denoise worker."""
    loads, swaps = LORA_LOADS.family(), LORA_SWAPS.family()
    seconds, held = LORA_SECONDS.family(), LORA_HELD.family()
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
    rows = ROWS.family()
    counts = engine.rows
    cumulative = [(str(bound), sum(n for r, n in counts.items() if r <= bound))
                  for bound in engine.row_bounds]
    rows.add_metric([], [*cumulative, ("+Inf", sum(counts.values()))],
                    sum(r * n for r, n in counts.items()))
    yield rows
    wait = engine.join_wait
    joins = JOIN_WAIT.family()
    joins.add_metric([], [("+Inf" if b == float("inf") else str(b), n)
                          for b, n in wait.cumulative], wait.total)
    yield joins
    occupancy = OCCUPANCY.family()
    for o in engine.occupancy:
        occupancy.add_metric([o.worker], o.runs / o.capacity)
    yield occupancy


def registry_with(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
