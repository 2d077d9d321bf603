"""The tensor cache of one process, built from the settings object: the stack's factory for
the workers, the CLI and the benches. Mooncake and torch load when it is opened, so a process
that only imports this (the CLI's client commands) never loads them. Redis alone is
``cachesvc.redis_client``; the API's byte entries, without torch, ``cachesvc.byte_entries``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachesvc.redis_client import RedisClient, open_redis
from config.settings import Settings

if TYPE_CHECKING:
    from cachesvc.tensor_cache import TensorCache


def open_cache(settings: Settings, client: RedisClient | None = None) -> TensorCache:
    """A TensorCache over the configured store; ``client`` shares an existing Redis pool."""
    from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints
    from cachesvc.tensor_cache import TensorCache

    store = MooncakeStore.connect(StoreEndpoints.configured(settings.store), settings.store)
    return TensorCache(store, client or open_redis(settings), settings.cache, settings.store,
                       stats_bucket_s=settings.retention.stats_bucket_s)
