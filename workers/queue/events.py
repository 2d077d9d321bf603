"""Record change notifications, so that nobody has to poll a record to follow a request.

Every script that writes a record publishes on the record's events channel, a sharded channel
(SPUBLISH): on a Redis Cluster it reaches only the shard that holds the record, not every node.
One pub/sub connection per process serves every waiter: a waiter registers a wake-up for one
request and is called on each change. A notification lost to a reconnect is made up for by a
reread every ``fallback_s``, which bounds what an idle follower costs Redis.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis.cluster import ClusterPubSub

from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from keys.names import request_record
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.script_args import WatchArgs
from workers.queue.script_library import events_channel

log = logging.getLogger(__name__)

# How often a follower rereads a record it heard nothing about: 200 idle followers cost 20
# reads a second.
FALLBACK_S = 10.0
_LISTEN_S = 1.0


class RecordEvents:
    """One subscriber thread that fans each record's notifications out to its waiters."""

    def __init__(self, client: RedisClient, fallback_s: float = FALLBACK_S) -> None:
        self.records = Records(client)
        self.fallback_s = fallback_s
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        # A cluster's pub/sub reads sharded messages from a connection per shard of its own.
        self._next_message = (self._pubsub.get_sharded_message
                              if isinstance(self._pubsub, ClusterPubSub)
                              else self._pubsub.get_message)
        self._waiters: dict[str, set[Callable[[], object]]] = {}
        # Held while (un)subscribing too, so a channel's last waiter leaving and a new one
        # arriving reach Redis in the order they happened.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="record-events", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, tenant: str, request_id: str,
                 wake: Callable[[], object]) -> Iterator[None]:
        """Call ``wake`` (from the subscriber thread) on every change of the request's record
        while the block runs. Subscribed before the block starts: read the record inside it."""
        record = request_record(tenant, request_id)
        channel = events_channel(record)
        with self._lock:
            if channel not in self._waiters:
                self._pubsub.ssubscribe(channel)
                # The hot scripts announce a change only to a record someone watches.
                self.records.scripts.run(WatchArgs(record, 1))
            self._waiters.setdefault(channel, set()).add(wake)
        try:
            yield
        finally:
            with self._lock:
                waiters = self._waiters[channel]
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[channel]
                    self._pubsub.sunsubscribe(channel)
                    self._unwatch(record)

    def _unwatch(self, record: str) -> None:
        try:
            self.records.scripts.run(WatchArgs(record, -1))
        except redis.RedisError:  # a count left too high costs announcements, nothing else
            log.warning("could not count a watcher of %s out", record, exc_info=True)

    def follow(self, tenant: str, request_id: str, timeout_s: float | None = None,
               reread_s: float | None = None) -> Iterator[RequestRecord]:
        """The record now and after each change until it is terminal (the last one yielded),
        and at least every ``reread_s`` (default: the fallback) so a caller can look up from
        the wait; TimeoutError after ``timeout_s``, KeyError if it does not exist."""
        changed: queue.SimpleQueue[None] = queue.SimpleQueue()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.watching(tenant, request_id, lambda: changed.put(None)):
            while True:
                record = self.records.get(tenant, request_id)
                if record is None:
                    raise KeyError(f"request {request_id} of tenant {tenant} does not exist")
                yield record
                if record.state.terminal:
                    return
                wait = reread_s or self.fallback_s
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"request {request_id} not finished within "
                                           f"{timeout_s} s (it is {record.state.value})")
                try:
                    changed.get(timeout=wait)
                except queue.Empty:
                    continue
                while not changed.empty():  # one reread covers every change so far
                    changed.get_nowait()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._pubsub.subscribed:
                self._stop.wait(0.05)
                continue
            try:
                message = self._next_message(timeout=_LISTEN_S)
            except REDIS_ERRORS as exc:
                # redis-py subscribes again on reconnect; waiters reread meanwhile.
                log.warning("record events: %s; reconnecting", exc)
                self._stop.wait(1.0)
                continue
            if message is None or message["type"] != "smessage":
                continue
            with self._lock:
                waiters = list(self._waiters.get(message["channel"].decode(), ()))
            for wake in waiters:
                wake()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()
