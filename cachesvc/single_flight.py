"""Cross-process single-flight: of N concurrent misses on one key, one computes.

The first caller takes a lease in Redis (``SET NX PX``) and computes, renewing the lease
while it does; the others poll the lease and, once it is gone, look the key up again. A waiter
whose wait runs out, or whose owner died without writing (its short lease then expires within
seconds), computes itself: the store's writes are idempotent, so a rare duplicate computation
is harmless while a lost one would stall a request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

import redis

from cachesvc.redis_client import RedisClient

T = TypeVar("T")
log = logging.getLogger(__name__)

# Delete the lease only if we still own it: a lease that expired and was taken by another caller
# must not be released by the slow first owner.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

# Extend the lease only if we still own it. ARGV: token, lease ms.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""


class Outcome(StrEnum):
    HIT = "hit"  # found without waiting
    WAITED = "waited"  # another caller computed it while we waited
    COMPUTED = "computed"  # we held the lease and computed
    COMPUTED_AFTER_TIMEOUT = "computed_after_timeout"


@dataclass(frozen=True, slots=True)
class FlightResult(Generic[T]):
    value: T
    outcome: Outcome


class SingleFlight:
    def __init__(self, client: RedisClient, *, lease_s: float, wait_s: float,
                 poll_s: float = 0.005, max_poll_s: float = 0.05) -> None:
        self._redis = client
        self._lease_ms = int(lease_s * 1000)
        self._wait_s = wait_s
        self._poll_s = poll_s
        self._max_poll_s = max_poll_s
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)

    def run(self, lock_key: str, lookup: Callable[[], T | None],
            compute: Callable[[], T]) -> FlightResult[T]:
        """``lookup()`` if it hits, else ``compute()`` exactly once across all callers.

        ``compute`` must make its result visible to ``lookup`` before it returns.
        """
        deadline = time.monotonic() + self._wait_s
        waited = False
        delay = self._poll_s
        while True:
            found = lookup()
            if found is not None:
                return FlightResult(found, Outcome.WAITED if waited else Outcome.HIT)
            token = uuid.uuid4().hex
            if self._redis.set(lock_key, token, nx=True, px=self._lease_ms):
                with self._renewing(lock_key, token):
                    try:
                        return FlightResult(compute(), Outcome.COMPUTED)
                    finally:
                        self._release(keys=[lock_key], args=[token])
            waited = True
            while self._redis.exists(lock_key):
                if time.monotonic() >= deadline:
                    return FlightResult(compute(), Outcome.COMPUTED_AFTER_TIMEOUT)
                time.sleep(delay)
                delay = min(delay * 2, self._max_poll_s)

    @contextmanager
    def _renewing(self, lock_key: str, token: str) -> Iterator[None]:
        """Renew the lease every third of its length until the block ends, so a slow
        computation keeps it and a dead owner loses it quickly."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self._lease_ms / 3000):
                try:
                    self._renew(keys=[lock_key], args=[token, self._lease_ms])
                except redis.RedisError as exc:  # the lease may lapse: a waiter recomputes
                    log.warning("could not renew the lease %s (%s)", lock_key, exc)

        thread = threading.Thread(target=renew, name="flight-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
