"""Cache counters per kind and tenant, exported to Prometheus and to per-minute Redis buckets.

Prometheus serves each process's scrape; the Redis buckets let one dashboard sum every process
without scraping them all. Increments are aggregated in memory and flushed by a background
thread, so the cache's hot path never waits on Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import redis
from prometheus_client import Counter

from cachesvc.redis_client import RedisClient
from keys import KeyKind
from keys.names import stats_bucket, stats_total, tenants_registry

log = logging.getLogger(__name__)

# The default of ``retention.stats_bucket_s``; the dashboard reads the last 30 minutes only.
BUCKET_RETENTION_S = 7 * 24 * 3600
_Child = Any  # a labelled prometheus Counter; the library exports no name for its type


class Event(StrEnum):
    LOOKUPS = "lookups"
    HITS = "hits"
    MISSES = "misses"
    BYTES_READ = "bytes_read"
    BYTES_WRITTEN = "bytes_written"
    COMPUTE_SECONDS_SAVED = "compute_seconds_saved"
    CORRUPT = "corrupt"
    EXPIRED = "expired"
    STORE_UNAVAILABLE = "store_unavailable"
    SINGLE_FLIGHT_WAITS = "single_flight_waits"
    WRITES_REFUSED = "writes_refused"  # by write admission: a kind that is not read back
    EVICTIONS = "evictions"  # removed by the value sweeper (``cachesvc.value_sweep``)
    # Recorded entries the sweeper found gone from the store: Mooncake's own eviction, or a
    # storage node lost.
    FOUND_GONE = "found_gone"


_PROM = {
    event: Counter(f"diffcache_cache_{event.value}", f"Cache {event.value.replace('_', ' ')}",
                   ["kind", "tenant"])
    for event in Event
}


class CacheCounters:
    """Thread-safe counters; ``flush`` moves pending increments into Redis."""

    def __init__(self, redis_client: RedisClient | None, flush_interval_s: float,
                 bucket_retention_s: int = BUCKET_RETENTION_S) -> None:
        self._redis = redis_client
        self._bucket_retention_s = bucket_retention_s
        self._lock = threading.Lock()
        # (tenant, minute) -> field -> amount, waiting for the next flush
        self._pending: dict[tuple[str, int], dict[str, float]] = defaultdict(
            lambda: defaultdict(float))
        self._children: dict[tuple[str, KeyKind, Event], _Child] = {}
        self._also_flushed: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if redis_client is not None:
            self._thread = threading.Thread(target=self._run, args=(flush_interval_s,),
                                            name="cache-counters", daemon=True)
            self._thread.start()

    def add(self, tenant: str, kind: KeyKind, event: Event, amount: float = 1.0) -> None:
        self.add_many(tenant, kind, {event: amount})

    def add_many(self, tenant: str, kind: KeyKind, events: Mapping[Event, float]) -> None:
        """Count several events of one lookup under one lock: this runs on every cache call."""
        minute = int(time.time() // 60)
        with self._lock:
            pending = self._pending[(tenant, minute)]
            for event, amount in events.items():
                self._prometheus(tenant, kind, event).inc(amount)
                pending[f"{kind.value}.{event.value}"] += amount

    def add_fields(self, tenant: str, fields: Mapping[str, float]) -> None:
        """Count under fields of the caller's naming (no ``kind.event`` of its own, so the
        per-kind readers pass them by), flushed with the rest."""
        minute = int(time.time() // 60)
        with self._lock:
            pending = self._pending[(tenant, minute)]
            for name, amount in fields.items():
                pending[name] += amount

    def also_flush(self, flush: Callable[[], None]) -> None:
        """Run ``flush`` first at every flush: the thread that takes counts to Redis takes
        other queued records there too (``cachesvc.value_index``)."""
        self._also_flushed.append(flush)

    def _prometheus(self, tenant: str, kind: KeyKind, event: Event) -> _Child:
        child = self._children.get((tenant, kind, event))
        if child is None:
            child = _PROM[event].labels(kind=kind.value, tenant=tenant)
            self._children[(tenant, kind, event)] = child
        return child

    def flush(self) -> None:
        """Write pending increments to Redis; on failure they stay pending for the next try."""
        if self._redis is None:
            return
        for also in self._also_flushed:
            try:
                also()
            except Exception:  # the counters' own flush must go on, whatever the other's fate
                log.exception("a flush beside the counters' failed")
        with self._lock:
            pending, self._pending = self._pending, defaultdict(lambda: defaultdict(float))
        if not pending:
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            for (tenant, minute), fields in pending.items():
                bucket = stats_bucket(tenant, minute)
                for field, amount in fields.items():
                    pipe.hincrbyfloat(bucket, field, amount)
                    pipe.hincrbyfloat(stats_total(tenant), field, amount)
                pipe.expire(bucket, self._bucket_retention_s)
                pipe.sadd(tenants_registry(), tenant)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not flush cache counters to Redis; keeping them for the next try",
                        exc_info=True)
            with self._lock:
                for slot, fields in pending.items():
                    for field, amount in fields.items():
                        self._pending[slot][field] += amount

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()


class QueuedCounters(CacheCounters):
    """Counters whose hot path queues its counts, which every flush (the background one each
    ``flush_interval_s``, or an explicit one) adds in first: counted in place, right after a
    transfer's wait, when their code and data have left the cache, the same increments cost
    several times more. Queued counts land in the minute of the flush that adds them."""

    def __init__(self, client: RedisClient, flush_interval_s: float, *,
                 bucket_retention_s: int) -> None:
        self._queued: deque[tuple[str, KeyKind, Mapping[Event, float]]] = deque()
        super().__init__(client, flush_interval_s, bucket_retention_s=bucket_retention_s)

    def queue(self, tenant: str, kind: KeyKind, events: Mapping[Event, float]) -> None:
        self._queued.append((tenant, kind, events))

    def flush(self) -> None:
        while True:
            try:
                tenant, kind, events = self._queued.popleft()
            except IndexError:
                break
            self.add_many(tenant, kind, events)
        super().flush()


def read_totals(client: RedisClient, tenant: str) -> dict[str, float]:
    """Counters of ``tenant`` since the stack started."""
    raw: dict[bytes, bytes] = client.hgetall(stats_total(tenant))  # type: ignore[assignment]
    return {k.decode(): float(v) for k, v in raw.items()}


def tenants(client: RedisClient) -> list[str]:
    raw: set[bytes] = client.smembers(tenants_registry())  # type: ignore[assignment]
    return sorted(t.decode() for t in raw)


def read_buckets(client: RedisClient, tenant: str, minutes: range) -> dict[int, dict[str, float]]:
    """Counters of ``tenant`` for each minute in ``minutes`` that has any."""
    pipe = client.pipeline(transaction=False)
    for minute in minutes:
        pipe.hgetall(stats_bucket(tenant, minute))
    out: dict[int, dict[str, float]] = {}
    for minute, raw in zip(minutes, pipe.execute(), strict=True):
        if raw:
            out[minute] = {k.decode(): float(v) for k, v in raw.items()}
    return out
