"""The one server that holds the queue: on a Redis Cluster, the master of the queue's hash slot
(``keys.names.QUEUE_TAG``), reached directly, so that commands whose keys the cluster client
cannot see without asking a server (FCALL, XREADGROUP) cost no extra round trip to another
node, and WAITAOF and WAIT share the connection of the writes they wait for. On one server, it
is that server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError, RedisClusterException

from cachesvc.redis_client import RedisClient, slot_server
from keys.names import QUEUE_TAG

log = logging.getLogger(__name__)

T = TypeVar("T")


def queue_server(client: RedisClient) -> redis.Redis:
    """The queue's server as the client last learnt the cluster's layout."""
    return slot_server(client, QUEUE_TAG).client


def relearn_layout(client: RedisClient, reason: object) -> None:
    """After a MOVED reply or a lost connection to the queue's server: learn the cluster's
    layout anew, so the next call goes to the master that holds the slot now."""
    if not isinstance(client, RedisCluster):
        return
    log.warning("the queue's server did not answer as its master (%s); relearning the "
                "cluster's layout", reason)
    try:
        client.nodes_manager.initialize()
    except (redis.RedisError, RedisClusterException) as exc:
        # Mid-failover no node may know the new master yet: the caller's error stands, and
        # its next call tries again.
        log.warning("could not relearn the cluster's layout yet: %s", exc)


def on_queue_server(client: RedisClient, call: Callable[[redis.Redis], T]) -> T:
    """``call`` on the queue's server. A MOVED answer (it ran nowhere) is run once more on the
    master that holds the slot now; a lost connection relearns the layout and is raised, since
    whether the command ran is unknown."""
    try:
        return call(queue_server(client))
    except MovedError as exc:
        relearn_layout(client, exc)
        return call(queue_server(client))
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        relearn_layout(client, exc)
        raise
