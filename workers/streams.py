"""A stage's Redis stream, read through a consumer group: at-least-once delivery with leases.

A delivery's attempt number is the entry's delivery count, which Redis raises on every claim by
another consumer; it is the fencing token that records check. A healthy worker renews its lease
(XCLAIM to itself, which resets the idle time without counting as a delivery) well inside the
idle timeout; a dead worker's entries are taken over with XAUTOCLAIM once they idle past it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from keys.names import consumer_group, stage_stream
from workers.messages import Job, Stage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    entry_id: str
    job: Job | None  # None: the entry could not be parsed, and goes to the dead letters
    raw: bytes
    attempt: int


class StageQueue:
    def __init__(self, client: redis.Redis, stage: Stage, consumer: str) -> None:
        self.redis = client
        self.stage = stage
        self.consumer = consumer
        self.stream = stage_stream(stage.value)
        self.group = consumer_group(stage.value)

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def next(self, block_ms: int, idle_timeout_ms: int) -> Delivery | None:
        """A dead consumer's stale entry if there is one, else a new entry, else None."""
        _, claimed, _ = self.redis.xautoclaim(self.stream, self.group, self.consumer,
                                              min_idle_time=idle_timeout_ms, count=1)
        if claimed:
            entry_id, fields = claimed[0]
            log.warning("took over %s from a consumer that went silent", entry_id)
            return self._delivery(entry_id, fields)
        got: Any = self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                         count=1, block=block_ms)
        if not got:
            return None
        entry_id, fields = got[0][1][0]
        return self._delivery(entry_id, fields)

    def _delivery(self, entry_id: bytes, fields: dict[bytes, bytes]) -> Delivery:
        eid = entry_id.decode()
        pending = self.redis.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
        attempt = int(pending[0]["times_delivered"]) if pending else 1
        raw = fields.get(b"job", b"")
        try:
            job: Job | None = Job.from_json(raw)
        except ValueError:
            log.error("entry %s of %s is not a valid job", eid, self.stream)
            job = None
        return Delivery(eid, job, raw, attempt)

    def ack(self, entry_id: str) -> None:
        self.redis.xack(self.stream, self.group, entry_id)

    def counts(self) -> tuple[int, int]:
        """(waiting, in flight): entries no worker has taken yet, and taken but not acked."""
        try:
            groups = self.redis.xinfo_groups(self.stream)
        except redis.ResponseError:  # the stream does not exist yet
            return 0, 0
        for g in groups:
            if g["name"].decode() == self.group:
                return int(g.get("lag") or 0), int(g["pending"])
        return 0, 0

    def depth(self) -> int:
        return sum(self.counts())

    @contextmanager
    def lease(self, entry_id: str, interval_s: float) -> Iterator[None]:
        """Renew our claim on ``entry_id`` every ``interval_s`` while the block runs."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(interval_s):
                try:
                    self.redis.xclaim(self.stream, self.group, self.consumer, min_idle_time=0,
                                      message_ids=[entry_id], justid=True)
                except redis.RedisError:
                    log.warning("could not renew the lease on %s", entry_id, exc_info=True)

        thread = threading.Thread(target=renew, name=f"lease-{entry_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def live_consumers(client: redis.Redis, stage: Stage, max_idle_ms: int = 3000) -> set[str]:
    """Names of the consumers of ``stage`` that polled within ``max_idle_ms``: live workers."""
    try:
        consumers = client.xinfo_consumers(stage_stream(stage.value), consumer_group(stage.value))
    except redis.ResponseError:  # no stream or group yet: no worker has started
        return set()
    # "idle" counts from the last read attempt; a blocked XREADGROUP keeps it low.
    return {c["name"].decode() for c in consumers if int(c["idle"]) <= max_idle_ms}
