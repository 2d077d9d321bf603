"""Worker heartbeats: each worker says every few seconds that it lives, busy or idle, so
readiness, joining and adapter routing can tell a live worker from a dead one."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from keys.names import worker_heartbeats
from workers.queue.messages import Stage

log = logging.getLogger(__name__)

HEARTBEAT_FORGET_MS = 3_600_000


class Heartbeat:
    """A thread that says every ``interval_s`` that this worker lives, busy or idle, so
    readiness never mistakes a long job for a dead worker."""

    def __init__(self, client: RedisClient, stage: Stage, consumer: str,
                 interval_s: float) -> None:
        self._redis = client
        self._key = worker_heartbeats(stage.value)
        self._consumer = consumer
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            now = int(time.time() * 1000)
            try:
                pipe = self._redis.pipeline(transaction=False)
                pipe.zadd(self._key, {self._consumer: now})
                # Workers that stopped beating long ago leave the set: it stays bounded.
                pipe.zremrangebyscore(self._key, 0, now - HEARTBEAT_FORGET_MS)
                pipe.execute()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat not written (%s); retrying", exc)
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(redis.RedisError):  # a stopped worker just ages out
            self._redis.zrem(self._key, self._consumer)


def live_workers(client: RedisClient, stage: Stage, within_s: float) -> set[str]:
    """Consumer names of ``stage``'s workers whose heartbeat is at most ``within_s`` old."""
    since = int((time.time() - within_s) * 1000)
    names: list[bytes] = client.zrangebyscore(  # type: ignore[assignment]
        worker_heartbeats(stage.value), since, "+inf")
    return {n.decode() for n in names}
