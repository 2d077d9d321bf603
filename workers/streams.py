"""A stage's Redis stream, read through a consumer group: at-least-once delivery with leases.

A delivery's attempt number is the entry's delivery count, which Redis raises on every claim by
another consumer; it is the fencing token that records check. A healthy worker renews its lease
(XCLAIM to itself, which resets the idle time without counting as a delivery) well inside the
idle timeout; a dead worker's entries are taken over with XAUTOCLAIM once they idle past it.
"""

from __future__ import annotations

import logging
import threading
import time
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
        self._next_reclaim = 0.0

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def next(self, block_ms: int, idle_timeout_ms: int, count: int = 1) -> list[Delivery]:
        """Stale entries of dead consumers if there are any, else up to ``count`` new ones.

        Stale entries are looked for at most every quarter of the idle timeout, which keeps
        the takeover delay within 1.25 idle timeouts and the hot path at one round trip.
        """
        now = time.monotonic()
        if now >= self._next_reclaim:
            _, claimed, _ = self.redis.xautoclaim(self.stream, self.group, self.consumer,
                                                  min_idle_time=idle_timeout_ms, count=count)
            if claimed:
                log.warning("took over %s from a consumer that went silent",
                            [e for e, _ in claimed])
                return [self._delivery(e, f, reclaimed=True) for e, f in claimed]
            self._next_reclaim = now + idle_timeout_ms / 4000
        got: Any = self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                         count=count, block=block_ms)
        if not got:
            return []
        return [self._delivery(e, f, reclaimed=False) for e, f in got[0][1]]

    def _delivery(self, entry_id: bytes, fields: dict[bytes, bytes],
                  reclaimed: bool) -> Delivery:
        eid = entry_id.decode()
        attempt = 1  # an entry read with ">" has never been delivered before
        if reclaimed:
            pending = self.redis.xpending_range(self.stream, self.group, min=eid, max=eid,
                                                count=1)
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

    def read_count(self) -> int:
        """Entries the group has read since it was created."""
        try:
            groups = self.redis.xinfo_groups(self.stream)
        except redis.ResponseError:  # the stream does not exist yet
            return 0
        for g in groups:
            if g["name"].decode() == self.group:
                return int(g.get("entries-read") or 0)
        return 0



class LeaseKeeper:
    """One thread per worker that renews the claim on the entry in hand every ``interval_s``
    (XCLAIM to ourselves resets its idle time without counting as a delivery)."""

    def __init__(self, queue: StageQueue, interval_s: float) -> None:
        self._queue = queue
        self._interval_s = interval_s
        self._held: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
        self._thread.start()

    @contextmanager
    def hold(self, *entry_ids: str) -> Iterator[None]:
        with self._lock:
            self._held = entry_ids
        try:
            yield
        finally:
            with self._lock:
                self._held = ()

    def _run(self) -> None:
        q = self._queue
        while not self._stop.wait(self._interval_s):
            with self._lock:
                held = self._held
            if not held:
                continue
            try:
                q.redis.xclaim(q.stream, q.group, q.consumer, min_idle_time=0,
                               message_ids=list(held), justid=True)
            except redis.RedisError:
                log.warning("could not renew the lease on %s", held, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def queue_counts(client: redis.Redis) -> dict[Stage, tuple[int, int]]:
    """(waiting, in flight) of every stage, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for stage in Stage:
        pipe.xinfo_groups(stage_stream(stage.value))
    out: dict[Stage, tuple[int, int]] = {}
    for stage, groups in zip(Stage, pipe.execute(raise_on_error=False), strict=True):
        out[stage] = (0, 0)
        if isinstance(groups, Exception):  # no stream yet: nothing queued
            continue
        for g in groups:
            if g["name"].decode() == consumer_group(stage.value):
                out[stage] = (int(g.get("lag") or 0), int(g["pending"]))
    return out


def live_consumers(client: redis.Redis, stage: Stage, max_idle_ms: int = 3000) -> set[str]:
    """Names of the consumers of ``stage`` that polled within ``max_idle_ms``: live workers."""
    try:
        consumers = client.xinfo_consumers(stage_stream(stage.value), consumer_group(stage.value))
    except redis.ResponseError:  # no stream or group yet: no worker has started
        return set()
    # "idle" counts from the last read attempt; a blocked XREADGROUP keeps it low.
    return {c["name"].decode() for c in consumers if int(c["idle"]) <= max_idle_ms}
