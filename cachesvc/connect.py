"""Connections of one process to Redis and the store, built from the settings object.

The store's modules (Mooncake, and torch for the tensor cache) are imported when a store
connection is opened, so a process that needs only Redis (the CLI's client commands) never
loads them, and the API, which opens byte entries only, never loads torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from cachesvc.errors import StoreUnavailableError
from cachesvc.settings import Settings

if TYPE_CHECKING:
    from cachesvc.byte_entries import ByteEntries
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


# One server, or a Redis Cluster (``redis.cluster`` in the settings). The queue's keys share
# one hash slot (``keys.names``), so every script runs the same on both.
RedisClient: TypeAlias = redis.Redis | RedisCluster

# What a Redis call can raise: a cluster's client also raises errors of its own (a slot no node
# serves while a replica is promoted) that are not RedisErrors. Loops that outlive an outage
# catch these.
REDIS_ERRORS = (redis.RedisError, RedisClusterException)


def open_redis(settings: Settings) -> RedisClient:
    if not settings.redis.url:
        raise ConnectionError("no Redis configured: run `diffcache up`, or set "
                              "DIFFCACHE_REDIS__URL")
    if settings.redis.cluster:
        return RedisCluster.from_url(settings.redis.url, health_check_interval=30)
    return redis.Redis.from_url(settings.redis.url, health_check_interval=30)


@dataclass(frozen=True)
class SlotServer:
    """The server that holds one hash slot, and how many replicas follow it: where a command
    that names no key (WAITAOF, SCAN) must go to mean that slot's keys."""

    client: redis.Redis  # that server alone
    replicas: int


def slot_server(client: RedisClient, key: str) -> SlotServer:
    """The server of ``key`` as the client last learnt the cluster's layout (no round trip);
    on one server, that server."""
    if not isinstance(client, RedisCluster):
        return SlotServer(client, 0)
    slot: int = client.keyslot(key)  # type: ignore[no-untyped-call]
    holders = client.nodes_manager.slots_cache.get(slot, [])
    master = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    return SlotServer(client.get_redis_connection(master), max(0, len(holders) - 1))


def open_cache(settings: Settings, client: RedisClient | None = None) -> TensorCache:
    """A TensorCache over the configured store; ``client`` shares an existing Redis pool."""
    from cachesvc.mooncake_store import MooncakeStore
    from cachesvc.tensor_cache import TensorCache

    store = MooncakeStore.connect(store_endpoints(settings), settings.store)
    return TensorCache(store, client or open_redis(settings), settings.cache, settings.store,
                       stats_bucket_s=settings.retention.stats_bucket_s)


def open_byte_entries(settings: Settings, client: RedisClient | None = None) -> ByteEntries:
    """Byte entries over the configured store (no torch); ``client`` shares a Redis pool."""
    from cachesvc.byte_entries import ByteEntries
    from cachesvc.mooncake_store import MooncakeStore

    store = MooncakeStore.connect(store_endpoints(settings), settings.store)
    return ByteEntries(store, client or open_redis(settings), settings.cache,
                       stats_bucket_s=settings.retention.stats_bucket_s)
