"""Logical Redis databases that keep tests apart without flushing what a worker uses.

Workers, the API and ``diffcache up`` use the database their Redis URL names (db 0 unless a URL
says otherwise), and nothing in diffcache depends on the number, so a test that needs an empty
Redis gets a database of its own on the worker-free stack's Valkey (``workerless_stack``) and
empties only that. No session worker reads that Valkey at all, and ``emptied`` refuses to empty a
database in which any worker has beaten its heartbeat recently.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from cachesvc.redis_client import open_redis
from config.settings import Settings
from workers.queue.heartbeats import live_workers
from workers.queue.messages import Stage

# One database per user. Valkey has 16 (0-15); db 0 stays the default of anything unconfigured.
CACHE = 1  # the tensor cache, single-flight and supervisor tests (``redis_client``)
STREAMS = 2
RETENTION = 3
API_HARDENING = 4
BATCHING = 5
EXTERNAL_REDIS = 6  # a `diffcache up` given the worker-free stack's Valkey as its Redis
API_START = 7  # an API process whose store does not answer
FIRST_DAY = 8  # an API serving the shipped model, with no workers
ADMISSION = 9  # the API and `diffcache submit` admitting against one published model
IMAGES = 10  # the API keeping uploaded images


def on_database(settings: Settings, db: int) -> Settings:
    """``settings`` with its Redis URL pointing at logical database ``db`` of the same server."""
    assert settings.redis.url, "no Redis configured"
    parts = urlsplit(settings.redis.url)
    url = urlunsplit(parts._replace(path=f"/{db}"))
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})


def emptied(settings: Settings) -> redis.Redis:
    """A client of ``settings``' Redis database, after emptying that database (only it, with
    FLUSHDB). Refuses if a worker has beaten its heartbeat in it within the last minute: the
    database would not be the test's own."""
    client = open_redis(settings)
    beating = {stage: found for stage in Stage if (found := live_workers(client, stage, 60))}
    assert not beating, f"{settings.redis.url} has live workers {beating}: not a test's own"
    client.flushdb()
    return client
