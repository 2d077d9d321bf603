"""Which computed entries the cache writes: a CFG feature of a tenant whose CFG lookups lately
found almost nothing (random seeds: no key recurs) is written only on its key's second write,
or sampled. Judged from the per-minute counters every process flushes, so workers agree."""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from cachesvc.counters import CacheCounters, Event, read_buckets
from cachesvc.redis_client import RedisClient
from config.settings import CacheSettings
from keys import KeyKind, StoreKey
from keys.names import write_seen

log = logging.getLogger(__name__)

# The kinds judged by their reuse. Outputs, checkpoints (which resumes and approximate reuse
# read) and embeddings are always written: they are read back by design, not by chance.
JUDGED = frozenset({KeyKind.CFG})
# How long a verdict stands in one process before the counters are read again.
VERDICT_S = 10.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One tenant's reuse of one kind over the window, and whether its writes are judged."""

    lookups: float
    hits: float
    cold: bool  # its writes are taken only on a key's second write, or sampled
    read_at: float


class WriteAdmission:
    """Decides, per key, whether a write is taken; counts what it refuses."""

    def __init__(self, client: RedisClient, settings: CacheSettings, counters: CacheCounters,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.settings = settings
        self.counters = counters
        self.clock = clock
        self._verdicts: dict[tuple[str, KeyKind], Verdict] = {}

    def admit(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each of ``keys`` is written. A refused key is remembered for the window (a
        Redis string of about 100 bytes per refused write), so its next write is taken: a key
        that recurs is read back from its third use on. On a Redis error every write is taken
        (a cache that writes too much only costs memory)."""
        sample = self.settings.admission_sample
        judged = [i for i, key in enumerate(keys)
                  if key.kind in JUDGED and not self.sampled(key, sample)
                  and self.verdict(key.tenant, key.kind).cold]
        taken = [True] * len(keys)
        if not judged:
            return taken
        try:
            pipe = self.client.pipeline(transaction=False)
            for i in judged:
                pipe.set(write_seen(keys[i]), 1, nx=True, ex=self.settings.admission_window_s)
            first = pipe.execute()
        except redis.RedisError as exc:
            log.warning("write admission skipped (%s): every write taken", exc)
            return taken
        refused: Counter[tuple[str, KeyKind]] = Counter()
        for i, new in zip(judged, first, strict=True):
            if new:
                taken[i] = False
                refused[(keys[i].tenant, keys[i].kind)] += 1
        for (tenant, kind), n in refused.items():
            self.counters.add(tenant, kind, Event.WRITES_REFUSED, n)
        return taken

    def verdict(self, tenant: str, kind: KeyKind) -> Verdict:
        """``tenant``'s reuse of ``kind`` over the window, read again every ``VERDICT_S``."""
        now = self.clock()
        known = self._verdicts.get((tenant, kind))
        if known is not None and now - known.read_at < VERDICT_S:
            return known
        s = self.settings
        minute = int(now // 60)
        try:
            buckets = read_buckets(self.client, tenant,
                                   range(minute - s.admission_window_s // 60 + 1, minute + 1))
        except redis.RedisError as exc:
            log.warning("write admission: counters unread (%s): every write taken", exc)
            buckets = {}
        lookups = sum(b.get(f"{kind.value}.{Event.LOOKUPS.value}", 0.0)
                      for b in buckets.values())
        hits = sum(b.get(f"{kind.value}.{Event.HITS.value}", 0.0) for b in buckets.values())
        cold = lookups >= s.admission_min_lookups and hits < s.admission_min_hit_rate * lookups
        verdict = Verdict(lookups, hits, cold, now)
        self._verdicts[(tenant, kind)] = verdict
        return verdict

    @staticmethod
    def sampled(key: StoreKey, sample: int) -> bool:
        """Whether ``key`` is one of the one in ``sample`` written though its kind is judged,
        chosen by its name, so that every worker samples the same keys; reuse that begins
        among new keys then still shows in the hit rate."""
        return zlib.crc32(key.ident.encode()) % sample == 0
