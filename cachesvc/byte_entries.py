"""Entries whose payload is plain bytes (outputs, uploaded adapters), read and written without
torch: all the API needs of the store, so the API process never loads torch. The format is the
tensor entries' own, with a flat uint8 payload, so a worker reads these as tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from cachesvc.codec import TensorSpec
from cachesvc.counted_store import CountedStore
from cachesvc.counters import Event, QueuedCounters
from cachesvc.entry_io import discard, expired, seal, send, verified
from cachesvc.errors import CodecError, EntryTooLargeError
from cachesvc.policy import policies
from cachesvc.redis_client import RedisClient, open_redis
from cachesvc.store_backend import StoreBackend
from cachesvc.ttl_index import TtlIndex, now_ms
from config.settings import CacheSettings, Settings
from keys import StoreKey


class ByteEntries:
    """Whole entries as bytes: each call registers a buffer of its own, which suits the API's
    few reads and writes (a result, an adapter upload) better than a pool held for its life."""

    def __init__(self, store: StoreBackend, client: RedisClient, settings: CacheSettings, *,
                 stats_bucket_s: int) -> None:
        self.store = store
        self.counters = QueuedCounters(client, settings.stats_flush_s,
                                       bucket_retention_s=stats_bucket_s)
        self._store = CountedStore(store, self.counters)
        self._policies = policies(settings)
        self._ttl_index = TtlIndex(client)

    def close(self) -> None:
        """Flush counters and close the store connection."""
        self.counters.close()
        self.store.close()

    def read(self, key: StoreKey) -> bytes | None:
        """The verified payload of ``key``'s entry; None if it is absent, corrupt or expired
        (the last two counted and removed, as a worker's read does). A hand-off, not a
        lookup: it counts the bytes read, no hit or miss, so hit rates measure reuse only."""
        for _ in range(2):  # a second time if the entry grew between its size and its read
            size = self._store.size_of(key)
            if size is None:
                return None
            with self._registered(size) as (buffer, ptr):
                try:
                    got = self._store.call(key, partial(self.store.get_into, str(key), ptr,
                                                        size))
                except EntryTooLargeError:
                    continue
                return None if got is None else self._verified(key, buffer, got)
        return None

    def _verified(self, key: StoreKey, buffer: ctypes.Array[ctypes.c_char],
                  size: int) -> bytes | None:
        view = memoryview(buffer).cast("B")[:size]
        try:
            header = verified(view)
        except CodecError as exc:
            discard(self._store, self.counters, key, Event.CORRUPT, exc)
            return None
        if expired(header):
            discard(self._store, self.counters, key, Event.EXPIRED, None)
            return None
        self.counters.queue(key.tenant, key.kind,
                            {Event.BYTES_READ: float(header.payload_bytes)})
        return bytes(view[header.size:])

    def write(self, key: StoreKey, data: bytes) -> None:
        """Store ``data`` under ``key`` with its kind's expiry and replication."""
        spec = TensorSpec("uint8", (len(data),))
        policy = self._policies[key.kind]
        expires_at_ms = policy.expiry_ms(now_ms())
        with self._registered(spec.entry_bytes) as (buffer, ptr):
            view = memoryview(buffer).cast("B")
            view[spec.header_bytes:spec.entry_bytes] = data
            seal(view, spec, 0, expires_at_ms)
            if expires_at_ms:  # indexed first: the sweep skips what has not expired
                self._ttl_index.add([key], expires_at_ms)
            config = self.store.put_config(soft_pin=policy.soft_pin)
            self._store.write(key, lambda: send(self.store, str(key), ptr, spec.entry_bytes,
                                                config))
        self.counters.queue(key.tenant, key.kind, {Event.BYTES_WRITTEN: float(len(data))})

    def exists(self, key: StoreKey) -> bool:
        return self._store.exists(key)

    def remove(self, key: StoreKey) -> bool:
        return self._store.remove(key)

    @contextmanager
    def _registered(self, size: int) -> Iterator[tuple[ctypes.Array[ctypes.c_char], int]]:
        buffer = ctypes.create_string_buffer(size)
        ptr = ctypes.addressof(buffer)
        self.store.register(ptr, size)
        try:
            yield buffer, ptr
        finally:
            self.store.unregister(ptr)


def open_byte_entries(settings: Settings, client: RedisClient | None = None) -> ByteEntries:
    """Byte entries over the configured store (no torch); ``client`` shares a Redis pool."""
    from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints

    store = MooncakeStore.connect(StoreEndpoints.configured(settings.store), settings.store)
    return ByteEntries(store, client or open_redis(settings), settings.cache,
                       stats_bucket_s=settings.retention.stats_bucket_s)
