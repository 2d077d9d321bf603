"""A stage's Redis streams, one per priority class, read through a consumer group:
at-least-once delivery with leases, interactive work first.

A delivery's attempt number is the entry's delivery count, which Redis raises on every claim by
another consumer; it is the fencing token that records check. A healthy worker renews its lease
(XCLAIM to itself, which resets the idle time without counting as a delivery) well inside the
idle timeout; a dead worker's entries are taken over with XAUTOCLAIM once they idle past it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from cachesvc.redis_client import RedisClient
from keys import Priority
from keys.names import consumer_group, stage_stream, worker_inbox, worker_inboxes
from workers.queue.messages import Job, Stage
from workers.queue.queue_server import on_queue_server
from workers.queue.record_write import RecordWrite
from workers.queue.schema import State, timestamp
from workers.queue.script_args import TakeArgs
from workers.queue.script_library import Result
from workers.queue.scripts import Scripts

PRIORITY_ORDER = (Priority.INTERACTIVE, Priority.BATCH)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: str
    job: Job | None  # None: the entry could not be parsed, and goes to the dead letters
    raw: bytes
    attempt: int
    # The claim the read made of the job's request (``StageQueue.next`` with a claim to
    # make); None: not claimed yet.
    claim: Result | None = None


class StageQueue:
    """A stage's shared streams and, with ``inbox_wait_ms`` set, this worker's inbox of jobs
    routed to it; an inbox job that waited longer than that goes to any worker."""

    def __init__(self, client: RedisClient, stage: Stage, consumer: str,
                 inbox_wait_ms: int | None = None) -> None:
        self.redis = client
        self.stage = stage
        self.consumer = consumer
        self.streams = tuple(stage_stream(stage.value, p.value) for p in PRIORITY_ORDER)
        self.group = consumer_group(stage.value)
        self.inbox = worker_inbox(stage.value, consumer) if inbox_wait_ms is not None else None
        self.inbox_wait_ms = inbox_wait_ms or 0
        self._next_reclaim = 0.0
        self._scripts = Scripts(client)

    def ensure_group(self) -> None:
        for stream in (*self.streams, *([self.inbox] if self.inbox else [])):
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self.inbox:
            self.redis.sadd(worker_inboxes(self.stage.value), self.inbox)

    def next(self, block_ms: int | None, idle_timeout_ms: int, count: int = 1,
             claim: RecordWrite | None = None) -> list[Delivery]:
        """Stale entries of dead consumers if there are any, else up to ``count`` new ones,
        interactive ones first; with ``block_ms`` None, only what is there now. With
        ``claim`` (what a claim by this worker writes), new entries found at once come
        claimed (``Delivery.claim``), read and fenced in one round trip.

        Stale entries are looked for at most every quarter of the idle timeout, which keeps
        the takeover delay within 1.25 idle timeouts and the hot path at one round trip.
        """
        now = time.monotonic()
        if now >= self._next_reclaim:
            if taken := self._take_over(idle_timeout_ms, count):
                return taken
            if self.inbox and (stale := self._stale_inbox_entries(count)):
                return stale
            self._next_reclaim = now + idle_timeout_ms / 4000
        # Interactive work first, then jobs routed here, then shared batch work: the first
        # class with entries is read, never two (taking batch entries in the same read as
        # interactive ones would commit this worker to them). Only when every class is
        # empty, one blocking read over all of them, which wakes on whichever gets work.
        ordered = self._ordered()
        if claim is not None:
            if (taken := self._take(ordered, count, claim)) or block_ms is None:
                return taken
        else:
            for stream in ordered[:-1]:
                got: Any = self._read([stream], count)
                if got:
                    return [self._delivery(stream, e, f, reclaimed=False)
                            for e, f in got[0][1]]
        got = self._read(ordered, count, block_ms)
        order = {s: i for i, s in enumerate(ordered)}
        batches = sorted(((name.decode(), entries) for name, entries in got or []),
                         key=lambda item: order[item[0]])
        return [self._delivery(stream, e, f, reclaimed=False)
                for stream, entries in batches for e, f in entries]

    def _read(self, streams: Sequence[str], count: int, block_ms: int | None = None) -> Any:
        """New entries of ``streams`` for this consumer, read on the queue's server."""
        return on_queue_server(self.redis, lambda r: r.xreadgroup(
            self.group, self.consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms))

    def take_interactive(self, count: int, claim: RecordWrite) -> list[Delivery]:
        """Up to ``count`` new interactive entries, claimed as they are read; none waiting,
        nothing (it never blocks)."""
        return self._take(self.streams[:1], count, claim)

    def _ordered(self) -> tuple[str, ...]:
        return (*self.streams[:-1], *([self.inbox] if self.inbox else []), self.streams[-1])

    def take_later(self, count: int, claim: RecordWrite) -> TakeArgs | None:
        """The call that takes up to ``count`` new entries as ``next`` would, for a caller to
        send with other calls in one round trip (``taken`` reads its answer); None when a
        look for stale entries is due, which only ``next`` makes."""
        if time.monotonic() >= self._next_reclaim:
            return None
        return self._take_args(self._ordered(), count, claim)

    def _take_args(self, ordered: tuple[str, ...], count: int,
                   claim: RecordWrite) -> TakeArgs:
        return TakeArgs(ordered, self.group, self.consumer, count, self.stage.value,
                        State.running(self.stage), timestamp(), claim)

    def _take(self, ordered: tuple[str, ...], count: int,
              claim: RecordWrite) -> list[Delivery]:
        """New entries of the first of ``ordered`` that has any, each claimed as it is read
        (``lua/take.lua``): one round trip for a busy worker's read and its fences."""
        return self.taken(self._scripts.run(self._take_args(ordered, count, claim)))

    def taken(self, answer: Any) -> list[Delivery]:
        """The deliveries a take (``take_later``) answered, claimed."""
        if not answer:
            return []
        stream = _text(answer[0])
        return [self._delivery(stream, e, {b"job": raw}, reclaimed=False,
                               claim=Result(code) if code else None)
                for e, raw, code in answer[1:]]

    def _take_over(self, idle_timeout_ms: int, count: int) -> list[Delivery]:
        """Entries that idled past the timeout under any consumer, in every stream a job of
        this stage can wait in (``stage_streams``): a live worker renews what it holds, so
        such an entry's worker is gone or stalled. One round trip, however many inboxes."""
        streams = stage_streams(self.redis, self.stage)
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xautoclaim(stream, self.group, self.consumer, min_idle_time=idle_timeout_ms,
                            count=count)
        taken: list[Delivery] = []
        for stream, answer in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(answer, redis.ResponseError):  # an inbox whose group is gone
                continue
            if isinstance(answer, Exception):
                raise answer
            _, claimed, _ = answer
            if claimed:
                log.warning("took over %s of %s from a consumer that went silent",
                            [e.decode() for e, _ in claimed], stream)
                taken += [self._delivery(stream, e, f, reclaimed=True) for e, f in claimed]
        return taken

    def _stale_inbox_entries(self, count: int) -> list[Delivery]:
        """Unread entries of another worker's inbox that waited past ``inbox_wait_ms`` (its
        worker is busy, or gone): any worker of the stage may take them."""
        inboxes: set[bytes] = self.redis.smembers(worker_inboxes(self.stage.value))  # type: ignore[assignment]
        # The clock that stamped the entry ids: the queue's server's.
        now_ms = int(on_queue_server(self.redis, lambda r: r.time())[0] * 1000)
        for raw in sorted(inboxes):
            inbox = raw.decode()
            if inbox == self.inbox:
                continue
            oldest = _oldest_unread(self.redis, inbox, self.group)
            if oldest is None or now_ms - int(oldest.partition("-")[0]) < self.inbox_wait_ms:
                continue
            got: Any = self._read([inbox], count)
            if got:
                log.info("took %d job(s) routed to a worker that did not take them",
                         len(got[0][1]))
                return [self._delivery(inbox, e, f, reclaimed=False) for e, f in got[0][1]]
        return []

    def own_pending(self, count: int,
                    in_hand: frozenset[tuple[str, str]] = frozenset()) -> list[Delivery]:
        """Up to ``count`` entries still pending under this consumer's own name, in the shared
        streams or its inbox, claimed again (a new delivery attempt, so the fence moves on
        from the one that was cut off); entries ``in_hand`` (stream, entry id) are still
        being worked on and are left alone."""
        for stream in (*self.streams, *([self.inbox] if self.inbox else [])):
            pending = self.redis.xpending_range(stream, self.group, min="-", max="+",
                                                count=count + len(in_hand),
                                                consumername=self.consumer)
            ids: list[Any] = [p["message_id"] for p in pending
                              if (stream, _text(p["message_id"])) not in in_hand][:count]
            if ids:
                claimed: Any = self.redis.xclaim(stream, self.group, self.consumer,
                                                 min_idle_time=0, message_ids=ids)
                return [self._delivery(stream, e, f, reclaimed=True) for e, f in claimed]
        return []

    def _delivery(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes],
                  reclaimed: bool, claim: Result | None = None) -> Delivery:
        eid = entry_id.decode()
        attempt = 1  # an entry read with ">" has never been delivered before
        if reclaimed:
            pending = self.redis.xpending_range(stream, self.group, min=eid, max=eid, count=1)
            attempt = int(pending[0]["times_delivered"]) if pending else 1
        raw = fields.get(b"job", b"")
        try:
            job: Job | None = Job.from_json(raw)
        except ValueError:
            log.error("entry %s of %s is not a valid job", eid, stream)
            job = None
        return Delivery(stream, eid, job, raw, attempt, claim)

    def ack(self, delivery: Delivery) -> None:
        self.redis.xack(delivery.stream, self.group, delivery.entry_id)

    def progress(self) -> tuple[int, int]:
        """Entries the group has read over every shared class since it was created, and how
        many of them it has in hand; one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xinfo_groups(stream)
        read = pending = 0
        for groups in pipe.execute(raise_on_error=False):
            if isinstance(groups, redis.ResponseError):  # the stream does not exist yet
                continue
            for g in groups:
                if g["name"].decode() == self.group:
                    read += int(g.get("entries-read") or 0)
                    pending += int(g["pending"])
        return read, pending


class LeaseKeeper:
    """One thread per worker that renews the claim on every entry in hand every
    ``interval_s`` (XCLAIM to ourselves resets its idle time without counting as a delivery).

    Holds nest: a read holds all it took while its first jobs run, so an entry read in the
    same batch as a long job never idles into a takeover while it waits its turn."""

    def __init__(self, queue: StageQueue, interval_s: float) -> None:
        self._queue = queue
        self._interval_s = interval_s
        self._held: Counter[tuple[str, str]] = Counter()  # (stream, entry id)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
        self._thread.start()

    @contextmanager
    def hold(self, *deliveries: Delivery) -> Iterator[None]:
        self.acquire(*deliveries)
        try:
            yield
        finally:
            self.release(*deliveries)

    def acquire(self, *deliveries: Delivery) -> None:
        """Renew ``deliveries`` until as many ``release`` calls name them."""
        with self._lock:
            self._held.update((d.stream, d.entry_id) for d in deliveries)

    def release(self, *deliveries: Delivery) -> None:
        with self._lock:
            self._held.subtract((d.stream, d.entry_id) for d in deliveries)
            self._held = +self._held  # drop what no hold names any more

    def _run(self) -> None:
        q = self._queue
        while not self._stop.wait(self._interval_s):
            with self._lock:
                held = tuple(self._held)
            if not held:
                continue
            for stream in {s for s, _ in held}:
                ids: list[Any] = [e for s, e in held if s == stream]
                try:
                    q.redis.xclaim(stream, q.group, q.consumer, min_idle_time=0,
                                   message_ids=ids, justid=True)
                except redis.RedisError:
                    log.warning("could not renew the lease on %s", ids, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def queue_counts(client: RedisClient) -> dict[tuple[Stage, Priority], tuple[int, int]]:
    """(waiting, in flight) of every stage and priority class, in one round trip."""
    classes = [(stage, p) for stage in Stage for p in PRIORITY_ORDER]
    pipe = client.pipeline(transaction=False)
    for stage, p in classes:
        pipe.xinfo_groups(stage_stream(stage.value, p.value))
    out: dict[tuple[Stage, Priority], tuple[int, int]] = {}
    for (stage, p), groups in zip(classes, pipe.execute(raise_on_error=False), strict=True):
        out[stage, p] = (0, 0)
        if isinstance(groups, Exception):  # no stream yet: nothing queued
            continue
        for g in groups:
            if g["name"].decode() == consumer_group(stage.value):
                out[stage, p] = (int(g.get("lag") or 0), int(g["pending"]))
    return out


def oldest_waiting(client: RedisClient, stage: Stage, priority: Priority) -> str | None:
    """The id of the oldest entry of one class that no worker has taken yet, if any."""
    return _oldest_unread(client, stage_stream(stage.value, priority.value),
                          consumer_group(stage.value))


def _oldest_unread(client: RedisClient, stream: str, group: str) -> str | None:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    for g in groups:
        if g["name"].decode() == group and int(g.get("lag") or 0) > 0:
            last = bytes(g["last-delivered-id"]).decode()
            entries: Any = client.xrange(stream, min=f"({last}", count=1)
            return entries[0][0].decode() if entries else None
    return None


def stage_streams(client: RedisClient, stage: Stage) -> list[str]:
    """Every stream a job of ``stage`` can wait in: the shared streams, one per class, then
    every worker's inbox. Takeover, retention and the watchdog all walk this one list, so a
    place a job can wait that one of them does not cover cannot exist."""
    inboxes: set[bytes] = client.smembers(worker_inboxes(stage.value))  # type: ignore[assignment]
    return [*(stage_stream(stage.value, p.value) for p in PRIORITY_ORDER),
            *sorted(i.decode() for i in inboxes)]


def _text(entry_id: bytes | str | int) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
