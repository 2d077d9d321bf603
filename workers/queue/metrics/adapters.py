"""What each denoise worker did with LoRA adapters (loads, swaps, load seconds, which it holds),
published to Redis so one scrape of the API's ``/metrics`` covers every worker."""

from __future__ import annotations

import logging

import redis
from pydantic.dataclasses import dataclass

from cachesvc.redis_client import RedisClient
from cachesvc.wire import Wire, WireError
from keys.names import adapter_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerAdapters:
    consumer: str
    loads: int
    swaps: int
    load_seconds: float
    held: tuple[str, ...]  # content hashes loaded, least recently used first
    active: tuple[str, ...] = ()  # the hashes it runs with now


_STATS: Wire[WorkerAdapters] = Wire("worker adapters", WorkerAdapters)


def publish_adapter_stats(client: RedisClient, stats: WorkerAdapters) -> None:
    """Best effort: a failed write is logged, and the next load or swap writes again."""
    try:
        client.hset(adapter_stats(), stats.consumer, _STATS.encode(stats))
    except redis.RedisError as exc:
        log.warning("adapter stats of %s not published (%s)", stats.consumer, exc)


def read_adapter_stats(client: RedisClient) -> list[WorkerAdapters]:
    raw: dict[bytes, bytes] = client.hgetall(adapter_stats())  # type: ignore[assignment]
    out = []
    for field, value in sorted(raw.items()):
        try:
            out.append(_STATS.decode(value))
        except WireError as exc:
            log.warning("ignoring unreadable adapter stats of %r (%s)", field, exc)
    return out
