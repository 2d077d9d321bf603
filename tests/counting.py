"""Reading back what a cache counted, the way the dashboard does: per-minute Redis buckets."""

from __future__ import annotations

import time

import redis

from cachesvc.counters import read_buckets
from cachesvc.tensor_cache import TensorCache


def counted(cache: TensorCache, client: redis.Redis, tenant: str) -> dict[str, float]:
    """Flush ``cache``'s counters, then sum ``tenant``'s buckets of this and the last minute."""
    cache.counters.flush()
    minute = int(time.time() // 60)
    totals: dict[str, float] = {}
    for bucket in read_buckets(client, tenant, range(minute - 1, minute + 1)).values():
        for field, value in bucket.items():
            totals[field] = totals.get(field, 0.0) + value
    return totals
