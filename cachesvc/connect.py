"""Connections of one process to Redis and the store, built from the settings object.

The store's modules (torch, Mooncake) are imported when a store connection is opened, so a
process that needs only Redis (the CLI's client commands, the API before its store link is up)
never loads them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from cachesvc.errors import StoreUnavailableError
from cachesvc.settings import Settings

if TYPE_CHECKING:
    from cachesvc.mooncake_store import StoreEndpoints
    from cachesvc.tensor_cache import TensorCache


def store_endpoints(settings: Settings) -> StoreEndpoints:
    from cachesvc.mooncake_store import StoreEndpoints

    store = settings.store
    if not store.master_address or not store.metadata_server:
        raise StoreUnavailableError(
            "no store configured: run `diffcache up`, or set DIFFCACHE_STORE__MASTER_ADDRESS "
            "and DIFFCACHE_STORE__METADATA_SERVER", op="connect")
    return StoreEndpoints(store.master_address, store.metadata_server,
                          store.master_metrics_url)


def open_redis(settings: Settings) -> redis.Redis:
    if not settings.redis.url:
        raise ConnectionError("no Redis configured: run `diffcache up`, or set "
                              "DIFFCACHE_REDIS__URL")
    return redis.Redis.from_url(settings.redis.url, health_check_interval=30)


def open_cache(settings: Settings, client: redis.Redis | None = None) -> TensorCache:
    """A TensorCache over the configured store; ``client`` shares an existing Redis pool."""
    from cachesvc.mooncake_store import MooncakeStore
    from cachesvc.tensor_cache import TensorCache

    store = MooncakeStore.connect(store_endpoints(settings), settings.store)
    return TensorCache(store, client or open_redis(settings), settings.cache, settings.store,
                       stats_bucket_s=settings.retention.stats_bucket_s)
