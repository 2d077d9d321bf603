"""What the denoise engines report, kept in Redis so the API exports one cluster-wide view:
rows per transformer forward, how long a job waited to take its first step, and how full
each worker's engine is."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from cachesvc.redis_client import RedisClient
from cachesvc.wire import Wire, WireError
from keys.names import engine_join_wait, engine_occupancy, engine_rows
from workers.queue.metrics import stages as stage_metrics
from workers.queue.metrics.stages import Histogram

log = logging.getLogger(__name__)

# Upper bounds of the rows-per-forward histogram.
ROW_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class Occupancy:
    worker: str
    runs: int
    capacity: int


# Each worker's (runs held, capacity), under its consumer name.
_LOAD: Wire[tuple[int, int]] = Wire("engine occupancy", tuple[int, int])


class EngineMetrics:
    """One worker's writer: everything a step changed, in one round trip."""

    def __init__(self, client: RedisClient, consumer: str, capacity: int) -> None:
        self._redis = client
        self._consumer = consumer
        self._capacity = capacity

    def step(self, rows: Iterable[int], join_waits: Iterable[float], runs: int) -> None:
        """A step's forwards (their row counts), the waits of runs that took their first
        step in it, and the runs the engine now holds."""
        pipe = self._redis.pipeline(transaction=False)
        for n, forwards in Counter(rows).items():
            pipe.hincrby(engine_rows(), f"rows:{n}", forwards)
        for seconds in join_waits:
            pipe.hincrby(engine_join_wait(), stage_metrics.bucket_field(seconds), 1)
            pipe.hincrbyfloat(engine_join_wait(), "sum", seconds)
            pipe.hincrby(engine_join_wait(), "count", 1)
        pipe.hset(engine_occupancy(), self._consumer, _LOAD.encode((runs, self._capacity)))
        pipe.execute()

    def close(self) -> None:
        self._redis.hdel(engine_occupancy(), self._consumer)


def read_rows(client: RedisClient) -> dict[int, int]:
    """Forwards per row count, over every engine since the keys were made."""
    raw: dict[bytes, bytes] = client.hgetall(engine_rows())  # type: ignore[assignment]
    return {int(k.decode().partition(":")[2]): int(v) for k, v in raw.items()}


def read_join_wait(client: RedisClient) -> Histogram:
    return stage_metrics.read_hash(client, engine_join_wait())


def read_occupancy(client: RedisClient) -> list[Occupancy]:
    raw: dict[bytes, bytes] = client.hgetall(engine_occupancy())  # type: ignore[assignment]
    out = []
    for worker, value in sorted(raw.items()):
        try:
            runs, capacity = _LOAD.decode(value)
        except WireError as exc:  # an older worker's; it is rewritten at its next step
            log.warning("ignoring unreadable engine occupancy of %r (%s)", worker, exc)
            continue
        out.append(Occupancy(worker.decode(), runs, capacity))
    return out
