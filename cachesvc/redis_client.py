"""The Redis client of one process: its type (one server or a Redis Cluster), what its calls
raise, and the server that holds a hash slot. A leaf: it imports nothing of the cache, so every
module that only talks to Redis (the queue, the records, the metrics) can use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from config.settings import Settings

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


