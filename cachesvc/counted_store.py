"""The store calls of a cache, each charged to the key it is for: an unreachable store is
counted against the key's kind and tenant, and a write into a full store waits while Mooncake
evicts, then names the cause when no storage node is mounted at all."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from cachesvc.counters import CacheCounters, Event
from cachesvc.errors import StoreFullError, StoreUnavailableError
from cachesvc.store_backend import StoreBackend
from keys import StoreKey

T = TypeVar("T")

# Mooncake evicts in the background once memory passes its high watermark, so a put into a full
# store fits again shortly; longer than this means the store is too small for its load.
FULL_STORE_WAIT_S = 3.0


class CountedStore:
    """``store`` with every call made on behalf of a key, and counted against it."""

    def __init__(self, store: StoreBackend, counters: CacheCounters) -> None:
        self.store = store
        self._counters = counters

    def call(self, key: StoreKey, op: Callable[[], T]) -> T:
        """Run one store call, counting an unreachable store against ``key``'s kind."""
        try:
            return op()
        except StoreUnavailableError:
            self._counters.add(key.tenant, key.kind, Event.STORE_UNAVAILABLE)
            raise

    def write(self, key: StoreKey, op: Callable[[], None]) -> None:
        """Run one store write, waiting out a full store while background eviction frees room."""
        delay = 0.01
        deadline = time.monotonic() + FULL_STORE_WAIT_S
        while True:
            try:
                return self.call(key, op)
            except StoreFullError as exc:
                if time.monotonic() + delay > deadline:
                    self._raise_if_no_storage_node(key, exc)
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    def exists(self, key: StoreKey) -> bool:
        return self.call(key, lambda: self.store.exists(str(key)))

    def batch_exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys:
            return []
        return self.call(keys[0], lambda: self.store.batch_exists([str(k) for k in keys]))

    def remove(self, key: StoreKey) -> bool:
        return self.call(key, lambda: self.store.remove(str(key)))

    def size_of(self, key: StoreKey) -> int | None:
        return self.call(key, lambda: self.store.size_of(str(key)))

    def _raise_if_no_storage_node(self, key: StoreKey, full: StoreFullError) -> None:
        """A store without storage nodes answers a put as a full one would: name the cause."""
        if self.store.storage_mounted() is False:
            self._counters.add(key.tenant, key.kind, Event.STORE_UNAVAILABLE)
            raise StoreUnavailableError("no storage node is mounted (every one is down or "
                                        "restarting)", key=str(key), op="put") from full
