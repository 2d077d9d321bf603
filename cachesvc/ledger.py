"""A job's ledger of lookups: each lookup a job makes (of the cache, or of a cache-like step it
skips) is counted once, here, into the cache counters and into the tally the job writes to its
request record. The two sums cannot drift, because nothing counts either of them alone."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from cachesvc.counters import Event, QueuedCounters
from keys import KeyKind


@dataclass(frozen=True, slots=True)
class Tally:
    """One kind's lookups and hits since the ledger was last taken."""

    lookups: int
    hits: int


class Ledger:
    """The lookups of one job (one attempt at one stage), counted as they are made."""

    def __init__(self, counters: QueuedCounters, tenant: str) -> None:
        self._counters = counters
        self.tenant = tenant
        self._lock = threading.Lock()  # a step's lookups may be answered on another thread
        self._tally: dict[KeyKind, Tally] = {}

    def count(self, kind: KeyKind, events: Mapping[Event, float]) -> None:
        """Count ``events`` of one lookup (or of several, in a batch) of ``kind``."""
        self._counters.queue(self.tenant, kind, events)
        lookups, hits = int(events.get(Event.LOOKUPS, 0)), int(events.get(Event.HITS, 0))
        if not lookups:
            return
        with self._lock:
            was = self._tally.get(kind, Tally(0, 0))
            self._tally[kind] = Tally(was.lookups + lookups, was.hits + hits)

    def lookup(self, kind: KeyKind, hit: bool) -> None:
        """One lookup that read nothing: an existence check, or a search that found no
        entry to read."""
        self.count(kind, {Event.LOOKUPS: 1.0, Event.HITS if hit else Event.MISSES: 1.0})

    def take(self) -> dict[KeyKind, Tally]:
        """What was counted since the last take, for the job's next record write."""
        with self._lock:
            taken, self._tally = self._tally, {}
        return taken
