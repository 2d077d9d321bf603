"""The typed tensor cache every worker uses: get, put, exists, remove and batched forms.

Entries are self-describing (``cachesvc.codec``) and checked on every read: a corrupt entry is
counted, removed and reported as a miss, never returned; an expired one likewise. A miss is
``None``; an unreachable store raises ``StoreUnavailableError``. The ``slot``/``put_from`` and
``get_into`` pair is the zero-copy path: the caller's tensor lives in registered memory already.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import redis
import torch

from cachesvc import codec
from cachesvc.buffers import BufferPool, RegisteredBuffer
from cachesvc.codec import TensorSpec
from cachesvc.counters import BUCKET_RETENTION_S, CacheCounters, Event
from cachesvc.errors import (
    CodecError,
    EntryTooLargeError,
    StoreFullError,
    StoreUnavailableError,
)
from cachesvc.mooncake_store import MooncakeStore, mounted_bytes, replicate_config
from cachesvc.policy import KindPolicy, policies
from cachesvc.settings import CacheSettings, StoreSettings
from cachesvc.single_flight import Outcome, SingleFlight
from cachesvc.ttl_index import TtlIndex, now_ms
from keys import StoreKey
from keys.names import flight_lock

log = logging.getLogger(__name__)
T = TypeVar("T")

# Mooncake evicts in the background once memory passes its high watermark, so a put into a full
# store fits again shortly; longer than this means the store is too small for its load.
FULL_STORE_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Registered memory laid out as one entry; fill ``tensor`` in place, then ``put_from``."""

    buffer: RegisteredBuffer
    spec: TensorSpec

    @property
    def tensor(self) -> torch.Tensor:
        return codec.typed_view(self.buffer.raw, self.spec.header_bytes, self.spec)


@dataclass(frozen=True, slots=True)
class Cached:
    """A tensor from ``get_or_compute`` and how it was obtained."""

    tensor: torch.Tensor
    outcome: Outcome | None  # None: the store was unavailable and the tensor was computed


@dataclass(frozen=True, slots=True)
class _Entry:
    """A verified entry and the compute time it recorded, which a hit counts as saved."""

    tensor: torch.Tensor
    cost_s: float

    def cloned(self) -> _Entry:
        return _Entry(self.tensor.clone(), self.cost_s)


class TensorCache:
    def __init__(self, store: MooncakeStore, client: redis.Redis, settings: CacheSettings,
                 store_settings: StoreSettings, *,
                 stats_bucket_s: int = BUCKET_RETENTION_S) -> None:
        self.store = store
        self.counters = CacheCounters(client, settings.stats_flush_s,
                                      bucket_retention_s=stats_bucket_s)
        self.ttl_index = TtlIndex(client)
        self._policies = policies(settings)
        self._pool = BufferPool(store, store_settings.buffer_slab_mib << 20,
                                store_settings.buffer_slabs)
        self._flight = SingleFlight(client, lease_s=settings.single_flight_lease_s,
                                    wait_s=settings.single_flight_wait_s)
        self._configs = {pin: replicate_config(soft_pin=pin) for pin in (False, True)}

    def close(self) -> None:
        """Flush counters and release registered memory and the store connection."""
        self.counters.close()
        self._pool.close()
        self.store.close()

    def policy(self, key: StoreKey) -> KindPolicy:
        return self._policies[key.kind]

    # Writing ----------------------------------------------------------------------------------

    @contextmanager
    def slot(self, spec: TensorSpec) -> Iterator[TensorSlot]:
        """Registered memory for one entry of ``spec``, for the zero-copy ``put_from``."""
        with self._pool.lease(spec.entry_bytes) as buf:
            yield TensorSlot(buf, spec)

    def put_from(self, key: StoreKey, slot: TensorSlot, *, cost_s: float = 0.0) -> None:
        """Store the entry laid out in ``slot``; ``cost_s`` is what computing it took."""
        self._seal(key, slot.buffer, 0, slot.spec, cost_s)
        self._write(key, lambda: self.store.put_from(
            str(key), slot.buffer.ptr, slot.spec.entry_bytes, self._config(key)))
        self._after_write([key], slot.spec.payload_bytes)

    def put(self, key: StoreKey, tensor: torch.Tensor, *, cost_s: float = 0.0) -> None:
        """Store a copy of ``tensor``. Content-keyed writes are idempotent: the first one wins."""
        spec = TensorSpec.of(tensor)
        with self.slot(spec) as slot:
            slot.tensor.copy_(tensor)
            self.put_from(key, slot, cost_s=cost_s)

    def batch_put(self, items: Sequence[tuple[StoreKey, torch.Tensor]], *,
                  cost_s: float = 0.0) -> None:
        """Store several tensors in one round trip; they must share one kind's policy."""
        if not items:
            return
        specs = [TensorSpec.of(t) for _, t in items]
        offsets = _offsets(specs)
        config = self._config(items[0][0])
        with self._pool.lease(offsets[-1]) as buf:
            for (key, tensor), spec, off in zip(items, specs, offsets, strict=False):
                codec.typed_view(buf.raw, off + spec.header_bytes, spec).copy_(tensor)
                self._seal(key, buf, off, spec, cost_s)
            keys = [k for k, _ in items]
            self._write(keys[0], lambda: self.store.batch_put_from(
                [str(k) for k in keys], [buf.ptr + o for o in offsets[:-1]],
                [s.entry_bytes for s in specs], config))
        self._after_write(keys, sum(s.payload_bytes for s in specs))

    # Reading ----------------------------------------------------------------------------------

    def get_into(self, key: StoreKey, buffer: RegisteredBuffer, *,
                 saved_s: float | None = None) -> torch.Tensor | None:
        """The entry as a view into ``buffer`` (no copy), or None on a miss."""
        size = self._call(key, lambda: self.store.get_into(str(key), buffer.ptr, buffer.capacity))
        entry = None if size is None else self._open(key, buffer, 0, size)
        self._count_lookup(key, entry, saved_s)
        return None if entry is None else entry.tensor

    def get(self, key: StoreKey, *, saved_s: float | None = None,
            lookup: bool = True) -> torch.Tensor | None:
        """A copy of the entry, or None on a miss. ``saved_s`` overrides the recorded cost.

        ``lookup=False`` is for handing an entry on (a stage reading its input, the API
        serving an output): it counts bytes read, but no lookup, hit or saving, so hit rates
        measure reuse only.
        """
        entry = self._fetch(key)
        self._count_read(key, entry, saved_s, lookup)
        return None if entry is None else entry.tensor

    def batch_get(self, keys: Sequence[StoreKey], *,
                  lookup: bool = True) -> list[torch.Tensor | None]:
        """Copies of several entries in one data round trip; None for each miss. A key may
        appear more than once (a prompt that is also the negative prompt): it is read once."""
        unique = list(dict.fromkeys(keys))  # Mooncake's batch read of one key twice fails
        sizes = [self._size_of(k) for k in unique]
        present = [(k, s) for k, s in zip(unique, sizes, strict=True) if s is not None]
        found: dict[StoreKey, _Entry | None] = {}
        if present:
            offsets = _offsets_of([s for _, s in present])
            with self._pool.lease(offsets[-1]) as buf:
                got = self._call(present[0][0], lambda: self.store.batch_get_into(
                    [str(k) for k, _ in present], [buf.ptr + o for o in offsets[:-1]],
                    [s for _, s in present]))
                for (key, _), off, n in zip(present, offsets, got, strict=False):
                    entry = None if n is None else self._open(key, buf, off, n)
                    found[key] = None if entry is None else entry.cloned()
        for key in unique:
            self._count_read(key, found.get(key), None, lookup)
        out: list[torch.Tensor | None] = []
        handed: set[StoreKey] = set()
        for key in keys:  # a repeated key gets its own copy: callers may write to theirs
            entry = found.get(key)
            out.append(None if entry is None else
                       entry.tensor.clone() if key in handed else entry.tensor)
            handed.add(key)
        return out

    def consume(self, key: StoreKey) -> torch.Tensor | None:
        """Read a single-consumer entry and delete it."""
        if not self.policy(key).delete_on_consume:
            raise ValueError(f"{key.kind} entries are shared and cannot be consumed: {key}")
        tensor = self.get(key)
        if tensor is not None:
            self.remove(key)
        return tensor

    def contains(self, key: StoreKey) -> bool:
        """Whether ``key`` is cached, counted as a lookup: a hit or a miss without a read."""
        found = self.exists(key)
        self.counters.add_many(key.tenant, key.kind, {
            Event.LOOKUPS: 1.0, Event.HITS if found else Event.MISSES: 1.0})
        return found

    def exists(self, key: StoreKey) -> bool:
        return self._call(key, lambda: self.store.exists(str(key)))

    def batch_exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys:
            return []
        return self._call(keys[0], lambda: self.store.batch_exists([str(k) for k in keys]))

    def remove(self, key: StoreKey) -> bool:
        return self._call(key, lambda: self.store.remove(str(key)))

    def get_or_compute(self, key: StoreKey, compute: Callable[[], torch.Tensor]) -> Cached:
        """The cached tensor, or ``compute()`` once across every process missing on ``key``."""

        def compute_and_put() -> _Entry:
            start = time.perf_counter()
            tensor = compute()
            cost = time.perf_counter() - start
            try:
                self.put(key, tensor, cost_s=cost)
            except StoreUnavailableError:
                log.warning("computed %s but could not store it", key, exc_info=True)
            return _Entry(tensor, cost)

        try:
            result = self._flight.run(flight_lock(key), lambda: self._fetch(key),
                                      compute_and_put)
        except StoreUnavailableError:
            return Cached(compute(), None)
        hit = result.outcome in (Outcome.HIT, Outcome.WAITED)
        self._count_lookup(key, result.value if hit else None, None)
        if result.outcome is Outcome.WAITED:
            self.counters.add(key.tenant, key.kind, Event.SINGLE_FLIGHT_WAITS)
        return Cached(result.value.tensor, result.outcome)

    # Internals --------------------------------------------------------------------------------

    def _config(self, key: StoreKey) -> object:
        return self._configs[self.policy(key).soft_pin]

    def _seal(self, key: StoreKey, buf: RegisteredBuffer, offset: int, spec: TensorSpec,
              cost_s: float) -> None:
        """Write the header of the entry at ``offset`` of ``buf``, whose payload is in place."""
        ttl = self.policy(key).ttl_s
        view = buf.memoryview()[offset:offset + spec.entry_bytes]
        codec.write_header(view, spec, checksum=codec.checksum(view[spec.header_bytes:]),
                           cost_us=int(cost_s * 1e6),
                           expires_at_ms=0 if ttl is None else now_ms() + int(ttl * 1000))

    def _after_write(self, keys: Sequence[StoreKey], payload_bytes: int) -> None:
        ttl = self.policy(keys[0]).ttl_s
        if ttl is not None:
            self.ttl_index.add(list(keys), now_ms() + int(ttl * 1000))
        self.counters.add(keys[0].tenant, keys[0].kind, Event.BYTES_WRITTEN, payload_bytes)

    def _fetch(self, key: StoreKey) -> _Entry | None:
        """A verified copy of the entry, or None; counts nothing but corruption and expiry."""
        with self._pool.lease(self._pool.slab_bytes) as buf:
            try:
                size = self._call(key, lambda: self.store.get_into(str(key), buf.ptr,
                                                                   buf.capacity))
            except EntryTooLargeError:
                size = None
            else:
                entry = None if size is None else self._open(key, buf, 0, size)
                return None if entry is None else entry.cloned()
        # Larger than a slab: learn its size and read it into a buffer of its own.
        entry_bytes = self._call(key, lambda: self.store.size_of(str(key)))
        if entry_bytes is None:
            return None
        with self._pool.lease(entry_bytes) as big:
            size = self._call(key, lambda: self.store.get_into(str(key), big.ptr, big.capacity))
            entry = None if size is None else self._open(key, big, 0, size)
            return None if entry is None else entry.cloned()

    def _open(self, key: StoreKey, buf: RegisteredBuffer, offset: int,
              size: int) -> _Entry | None:
        """Validate the entry of ``size`` bytes at ``offset``; a view of it, or None."""
        view = buf.memoryview()[offset:offset + size]
        try:
            header = codec.read_header(view, size)
            if codec.checksum(view[header.size:]) != header.checksum:
                raise CodecError("payload checksum mismatch")
        except CodecError as exc:
            log.error("removing corrupt cache entry %s: %s", key, exc)
            self.counters.add(key.tenant, key.kind, Event.CORRUPT)
            self.remove(key)
            return None
        if header.expires_at_ms and header.expires_at_ms <= now_ms():
            self.counters.add(key.tenant, key.kind, Event.EXPIRED)
            self.remove(key)
            return None
        tensor = codec.typed_view(buf.raw, offset + header.size, header.spec)
        return _Entry(tensor, header.cost_us / 1e6)

    def _count_read(self, key: StoreKey, entry: _Entry | None, saved_s: float | None,
                    lookup: bool) -> None:
        if not lookup:
            if entry is not None:
                self.counters.add(key.tenant, key.kind, Event.BYTES_READ,
                                  float(entry.tensor.numel() * entry.tensor.element_size()))
            return
        self._count_lookup(key, entry, saved_s)

    def _count_lookup(self, key: StoreKey, entry: _Entry | None,
                      saved_s: float | None) -> None:
        if entry is None:
            events = {Event.LOOKUPS: 1.0, Event.MISSES: 1.0}
        else:
            events = {
                Event.LOOKUPS: 1.0,
                Event.HITS: 1.0,
                Event.BYTES_READ: float(entry.tensor.numel() * entry.tensor.element_size()),
                Event.COMPUTE_SECONDS_SAVED: entry.cost_s if saved_s is None else saved_s,
            }
        self.counters.add_many(key.tenant, key.kind, events)

    def _write(self, key: StoreKey, op: Callable[[], None]) -> None:
        """Run one store write, waiting out a full store while background eviction frees room."""
        delay = 0.01
        deadline = time.monotonic() + FULL_STORE_WAIT_S
        while True:
            try:
                return self._call(key, op)
            except StoreFullError as exc:
                if time.monotonic() + delay > deadline:
                    self._raise_if_no_storage_node(key, exc)
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    def _raise_if_no_storage_node(self, key: StoreKey, full: StoreFullError) -> None:
        """A store without storage nodes answers a put as a full one would: name the cause."""
        url = self.store.endpoints.metrics_url
        if url is not None and mounted_bytes(url) == 0:
            self.counters.add(key.tenant, key.kind, Event.STORE_UNAVAILABLE)
            raise StoreUnavailableError("no storage node is mounted (every one is down or "
                                        "restarting)", key=str(key), op="put") from full

    def _size_of(self, key: StoreKey) -> int | None:
        return self._call(key, lambda: self.store.size_of(str(key)))

    def _call(self, key: StoreKey, op: Callable[[], T]) -> T:
        """Run one store call, counting an unreachable store against ``key``'s kind."""
        try:
            return op()
        except StoreUnavailableError:
            self.counters.add(key.tenant, key.kind, Event.STORE_UNAVAILABLE)
            raise



def _offsets(specs: Sequence[TensorSpec]) -> list[int]:
    return _offsets_of([s.entry_bytes for s in specs])


def _offsets_of(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive, aligned entries, plus the total size as the last item."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + -(-size // codec.ALIGN) * codec.ALIGN)
    return out
