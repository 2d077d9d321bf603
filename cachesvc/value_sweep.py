"""Eviction by value per byte: once the recorded entries (``cachesvc.value_index``) hold more
than ``cache.evict_above`` of the store's capacity, remove those of lowest priority until they
hold ``cache.evict_to``, taking first from tenants beyond ``cache.max_share``.

An entry a reader holds the lease of is kept (Mooncake refuses the removal), as is an input a
request in flight holds (``value_index.hold``) until the request ends; an entry found already
gone is forgotten and counted: that is Mooncake's own eviction at work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachesvc.counters import CacheCounters, Event, tenants
from cachesvc.errors import StoreOperationError
from cachesvc.mooncake_store import mounted_bytes
from cachesvc.redis_client import RedisClient
from cachesvc.store_backend import Eviction, StoreBackend
from cachesvc.value_index import drop_holds, forget, held, held_inputs, read_clock
from config.settings import CacheSettings, Settings
from keys import StoreKey
from keys.names import value_clock, value_keys

log = logging.getLogger(__name__)

# Candidates read from a tenant's priority set at a time.
PAGE = 256

# Which of a tenant's request ids have ended (done, failed, cancelled or forgotten): the
# queue's knowledge, which the cache layer is handed rather than imports. A request resumed
# or recomputed later goes through encode again, which holds its inputs anew.
Ended = Callable[[str, Sequence[str]], set[str]]


@dataclass(frozen=True, slots=True)
class SweepReport:
    """One sweep: the bytes recorded before and after, and what became of the candidates."""

    held_before: int
    held_after: int
    evicted: int = 0  # removed by the policy
    found_gone: int = 0  # already gone from the store: Mooncake evicted them, or a node died
    busy: int = 0  # kept: a read held them, or their write was unfinished
    needed: int = 0  # kept: a request in flight holds them as its inputs


@dataclass(slots=True)
class _Tenant:
    """A tenant's bytes and its next candidates, lowest priority first."""

    held: int
    candidates: list[tuple[str, float]] = field(default_factory=list)
    skipped: int = 0  # busy or needed entries still at the head of its priority set
    exhausted: bool = False
    needed: set[str] | None = None  # the inputs its requests in flight hold, once read


def store_capacity(settings: Settings, last: int | None = None) -> int:
    """The bytes the sweeper keeps the cache within: ``cache.capacity_mib``, else what every
    mounted storage node contributes as the master reports it, else ``last`` (what it reported
    before), else one node's segment."""
    if settings.cache.capacity_mib is not None:
        return settings.cache.capacity_mib << 20
    url = settings.store.master_metrics_url
    mounted = mounted_bytes(url) if url else None
    return mounted or last or settings.store.segment_mib << 20


class ValueSweeper:
    """Keeps the cache's recorded entries within their share of ``capacity_bytes``."""

    def __init__(self, client: RedisClient, store: StoreBackend, counters: CacheCounters,
                 capacity_bytes: int, settings: CacheSettings,
                 ended: Ended | None = None) -> None:
        self._redis = client
        self._store = store
        self._counters = counters
        self.capacity = capacity_bytes
        self.settings = settings
        # None: a hold lasts until released or lapsed. A request cancelled, failed or dead
        # lettered never reaches the decode that releases its holds.
        self._ended = ended

    def sweep(self) -> SweepReport:
        """One pass over every tenant's recorded entries."""
        state = {t: _Tenant(sum(held(self._redis, t).values())) for t in tenants(self._redis)}
        before = sum(s.held for s in state.values())
        if before <= self.capacity * self.settings.evict_above:
            return SweepReport(before, before)
        target = self.capacity * self.settings.evict_to
        clock = read_clock(self._redis)
        counts = {outcome: 0 for outcome in Eviction}
        needed = 0
        total = before
        while total > target:
            victim = self._victim(state)
            if victim is None:
                break  # nothing left that may be removed
            tenant, by_share = victim
            key, priority = state[tenant].candidates.pop(0)
            if key in self._needed(tenant, state[tenant]):
                needed += 1
                state[tenant].skipped += 1
                continue
            try:
                outcome = self._store.evict(key)
            except StoreOperationError as exc:
                log.warning("value sweep: kept %s (%s)", key, exc)
                outcome = Eviction.BUSY
            counts[outcome] += 1
            if outcome is Eviction.BUSY:
                state[tenant].skipped += 1
                continue
            store_key = StoreKey.parse(key)
            size = forget(self._redis, [store_key])[0]
            state[tenant].held -= size
            total -= size
            if outcome is Eviction.REMOVED:
                if not by_share:  # a share's eviction is out of the global order: no aging
                    clock = max(clock, priority)
                self._counters.add(tenant, store_key.kind, Event.EVICTIONS)
            else:
                self._counters.add(tenant, store_key.kind, Event.FOUND_GONE)
        self._redis.set(value_clock(), repr(clock))
        log.info("value sweep: %d bytes recorded, %d now; %d evicted, %d found gone, %d busy, "
                 "%d needed", before, total, counts[Eviction.REMOVED], counts[Eviction.ABSENT],
                 counts[Eviction.BUSY], needed)
        return SweepReport(before, total, counts[Eviction.REMOVED], counts[Eviction.ABSENT],
                           counts[Eviction.BUSY], needed)

    def _needed(self, tenant: str, s: _Tenant) -> set[str]:
        """The inputs ``tenant``'s requests in flight hold, read once a sweep; the holds of
        requests that have ended are dropped."""
        if s.needed is None:
            holds = held_inputs(self._redis, tenant, time.time())
            ended = self._ended(tenant, list(holds)) if self._ended and holds else set()
            drop_holds(self._redis, tenant, {r: holds.pop(r) for r in ended & holds.keys()})
            s.needed = set().union(*holds.values())
        return s.needed

    def _victim(self, state: dict[str, _Tenant]) -> tuple[str, bool] | None:
        """The tenant to take the next entry from, and whether for its share: the one
        furthest beyond its share, else the one whose lowest priority is lowest
        (GreedyDual's global order)."""
        share = self.capacity * self.settings.max_share
        live = [t for t, s in state.items() if self._refill(t, s)]
        over = [t for t in live if state[t].held > share]
        if over:
            return max(over, key=lambda t: state[t].held), True
        if not live:
            return None
        return min(live, key=lambda t: state[t].candidates[0][1]), False

    def _refill(self, tenant: str, s: _Tenant) -> bool:
        """Whether ``tenant`` has a candidate, reading its next page if it ran out."""
        if not s.candidates and not s.exhausted:
            start = s.skipped  # the busy ones stay at the head of the set
            page: list[tuple[bytes, float]] = self._redis.zrange(  # type: ignore[assignment]
                value_keys(tenant)[1], start, start + PAGE - 1, withscores=True)
            s.candidates = [(k.decode(), score) for k, score in page]
            s.exhausted = not page
        return bool(s.candidates)
