"""Expiry of TTL'd entries: checked on every read, and swept for entries nobody reads.

Mooncake has no per-object TTL, so an entry's expiry is written into its header (a read past it
is a miss and removes the entry) and into a per-tenant Redis sorted set that ``sweep`` walks.
"""

from __future__ import annotations

import logging
import time

from cachesvc.redis_client import RedisClient
from cachesvc.store_backend import StoreBackend
from cachesvc.value_index import forget
from keys import StoreKey
from keys.names import tenants_registry, ttl_index

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class TtlIndex:
    def __init__(self, client: RedisClient) -> None:
        self._redis = client

    def add(self, keys: list[StoreKey], expires_at_ms: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.zadd(ttl_index(key.tenant), {str(key): expires_at_ms})
            pipe.sadd(tenants_registry(), key.tenant)
        pipe.execute()

    def sweep(self, store: StoreBackend, page: int = 1000) -> int:
        """Remove every expired entry, ``page`` at a time per tenant; returns how many were
        removed. Pages repeat until none is left, so the index never outgrows the sweep."""
        removed = 0
        now = now_ms()
        tenants: set[bytes] = self._redis.smembers(tenants_registry())  # type: ignore[assignment]
        for tenant in tenants:
            index = ttl_index(tenant.decode())
            while True:
                expired: list[bytes] = self._redis.zrangebyscore(  # type: ignore[assignment]
                    index, 0, now, start=0, num=page)
                for raw_key in expired:
                    if store.remove(raw_key.decode()):
                        removed += 1
                if expired:  # records first: an index row left behind is swept again
                    forget(self._redis, [StoreKey.parse(k.decode()) for k in expired])
                    self._redis.zrem(index, *expired)
                if len(expired) < page:
                    break
        if removed:
            log.info("swept %d expired cache entries", removed)
        return removed
