"""The typed tensor cache every worker uses: get, put, exists, remove and batched forms.

Entries are self-describing (``cachesvc.codec``) and every read verifies the header and the whole
payload's checksum before it returns: a corrupt entry is counted, removed and reported as a miss,
never returned; an expired one likewise. A miss is ``None``; an unreachable store raises
``StoreUnavailableError``. The ``slot``/``put_from`` and ``get_into`` pair is the zero-copy path.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

import redis
import torch

from cachesvc import codec
from cachesvc.buffers import BufferPool, RegisteredBuffer
from cachesvc.codec import Header, TensorSpec
from cachesvc.counters import BUCKET_RETENTION_S, CacheCounters, Event
from cachesvc.errors import (
    CacheError,
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
from keys import KeyKind, StoreKey
from keys.names import flight_lock

log = logging.getLogger(__name__)
T = TypeVar("T")

# Mooncake evicts in the background once memory passes its high watermark, so a put into a full
# store fits again shortly; longer than this means the store is too small for its load.
FULL_STORE_WAIT_S = 3.0

# From these sizes up an entry moves through a get or put session and ranged transfers, whose
# wait sleeps: get_into and put_from spin while they wait, which on a machine short of cores
# takes a core from the transfer itself. A spinning get_into also leaves the bytes it received in
# another core's cache, where the checksum then reads them at a fraction of its speed, so reads
# gain from a smaller size up than writes, which hash before they send either way. Below them
# the one-call forms answer sooner: a session's two or three waits each cost a wake-up.
SESSION_MIN_BYTES = 256 << 10
PUT_SESSION_MIN_BYTES = 4 << 20
# A sized read of a larger entry arrives in pieces of at most this, each hashed as soon as it
# lands, while it is still in the last-level cache; hashed after the whole transfer, the first
# pieces of a large entry would be read back from memory, at a third of the speed.
READ_PIECE_BYTES = 16 << 20
# Threads for the TTL index writes (a Redis round trip each) that run while entries are sent.
IO_THREADS = 2


class _QueuedCounters(CacheCounters):
    """The cache's counters. The hot path queues its counts and every flush (the background one
    each ``stats_flush_s``, or an explicit one) adds them in first: counted in place, right
    after a transfer's wait, when their code and data have left the cache, the same increments
    cost several times more. Queued counts land in the minute of the flush that adds them."""

    def __init__(self, client: redis.Redis, flush_interval_s: float, *,
                 bucket_retention_s: int) -> None:
        self._queued: deque[tuple[str, KeyKind, Mapping[Event, float]]] = deque()
        super().__init__(client, flush_interval_s, bucket_retention_s=bucket_retention_s)

    def queue(self, tenant: str, kind: KeyKind, events: Mapping[Event, float]) -> None:
        self._queued.append((tenant, kind, events))

    def flush(self) -> None:
        while True:
            try:
                tenant, kind, events = self._queued.popleft()
            except IndexError:
                break
            self.add_many(tenant, kind, events)
        super().flush()


class _Read(Enum):
    """How a sized read ended when it did not end with a verified header."""

    MISS = "miss"
    OTHER_SIZE = "other size"  # the entry is not the size the caller expected: read it whole


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Registered memory laid out as one entry of ``spec``: fill ``tensor`` in place, then
    ``put_from``; or ``get_into`` it, which returns ``tensor`` once the entry is verified."""

    buffer: RegisteredBuffer
    spec: TensorSpec
    tensor: torch.Tensor = field(init=False, repr=False, compare=False)
    layout: codec.Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Made once, before any transfer: after a transfer's wait the same work runs cold.
        object.__setattr__(self, "tensor", codec.typed_view(self.buffer.raw,
                                                            self.spec.header_bytes, self.spec))
        object.__setattr__(self, "layout", codec.Layout.of(self.spec))


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
    nbytes: int

    def cloned(self) -> _Entry:
        return _Entry(self.tensor.clone(), self.cost_s, self.nbytes)


class TensorCache:
    def __init__(self, store: MooncakeStore, client: redis.Redis, settings: CacheSettings,
                 store_settings: StoreSettings, *,
                 stats_bucket_s: int = BUCKET_RETENTION_S) -> None:
        self.store = store
        self.counters = _QueuedCounters(client, settings.stats_flush_s,
                                        bucket_retention_s=stats_bucket_s)
        self.ttl_index = TtlIndex(client)
        self._policies = policies(settings)
        self._pool = BufferPool(store, store_settings.buffer_slab_mib << 20,
                                store_settings.buffer_slabs)
        self._flight = SingleFlight(client, lease_s=settings.single_flight_lease_s,
                                    wait_s=settings.single_flight_wait_s)
        self._configs = {pin: replicate_config(soft_pin=pin) for pin in (False, True)}
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="cache-io")

    def close(self) -> None:
        """Flush counters and release registered memory and the store connection."""
        self.counters.close()
        self._io.shutdown()
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
        expires_at_ms = self._expiry(key)
        indexed = self._index_ttl([key], expires_at_ms)
        self._write(key, lambda: self._store_entry(key, slot, int(cost_s * 1e6), expires_at_ms))
        self._after_write([(key, slot.spec.payload_bytes)], indexed)

    def put(self, key: StoreKey, tensor: torch.Tensor, *, cost_s: float = 0.0) -> None:
        """Store a copy of ``tensor``. Content-keyed writes are idempotent: the first one wins."""
        spec = TensorSpec.of(tensor)
        with self.slot(spec) as slot:
            slot.tensor.copy_(tensor)
            self.put_from(key, slot, cost_s=cost_s)

    def batch_put(self, items: Sequence[tuple[StoreKey, torch.Tensor]], *,
                  cost_s: float | Sequence[float] = 0.0) -> None:
        """Store several tensors in one round trip; they must share one kind's policy (they
        may be of several tenants). ``cost_s`` is what computing each took: one figure for
        all, or one per item."""
        if not items:
            return
        costs = [cost_s] * len(items) if isinstance(cost_s, float | int) else list(cost_s)
        if len(costs) != len(items):
            raise ValueError(f"batch_put of {len(items)} entries given {len(costs)} costs")
        specs = [TensorSpec.of(t) for _, t in items]
        if any(spec.entry_bytes >= PUT_SESSION_MIN_BYTES for spec in specs):
            # Large entries go one by one through a put session, which waits by sleeping
            # (see PUT_SESSION_MIN_BYTES); the rest still travel together.
            large = {i for i, spec in enumerate(specs)
                     if spec.entry_bytes >= PUT_SESSION_MIN_BYTES}
            for i in sorted(large):
                self.put(items[i][0], items[i][1], cost_s=costs[i])
            rest = [i for i in range(len(items)) if i not in large]
            self.batch_put([items[i] for i in rest], cost_s=[costs[i] for i in rest])
            return
        offsets = _offsets(specs)
        keys = [k for k, _ in items]
        config = self._config(keys[0])
        expires_at_ms = self._expiry(keys[0])
        indexed = self._index_ttl(keys, expires_at_ms)
        with self._pool.lease(offsets[-1]) as buf:
            for (_, tensor), spec, off, cost in zip(items, specs, offsets[:-1], costs,
                                                    strict=True):
                codec.typed_view(buf.raw, off + spec.header_bytes, spec).copy_(tensor)
                self._seal(buf, off, spec, int(cost * 1e6), expires_at_ms)
            self._write(keys[0], lambda: self.store.batch_put_from(
                [str(k) for k in keys], [buf.ptr + o for o in offsets[:-1]],
                [s.entry_bytes for s in specs], config))
        self._after_write([(k, s.payload_bytes) for k, s in zip(keys, specs, strict=True)],
                          indexed)

    # Reading ----------------------------------------------------------------------------------

    def get_into(self, key: StoreKey, target: TensorSlot | RegisteredBuffer, *,
                 saved_s: float | None = None) -> torch.Tensor | None:
        """The verified entry as a view into the target's registered memory (no copy), or None
        on a miss. A slot also says what the caller expects, so the read is sized from its spec
        and its header checked against the slot's; an entry of another spec is read whole and
        returned as it is, just as into a bare buffer."""
        if isinstance(target, TensorSlot):
            entry = self._read(key, target.buffer, target.spec.entry_bytes, target)
        else:
            entry = self._read(key, target, None)
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
                    found[key] = None if n is None else self._open(key, buf, off, n, copy=True)
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

    def lookup_many(self, keys: Sequence[StoreKey]) -> list[torch.Tensor | None]:
        """``get`` of several keys that will mostly miss (a cache asked for entries it may
        never have seen): one existence round trip for all, then a read of each present one.
        Every key counts as a lookup, a hit or a miss, as ``get`` counts it."""
        out: list[torch.Tensor | None] = []
        for key, present in zip(keys, self.batch_exists(keys), strict=True):
            entry = self._fetch(key) if present else None  # it may go in between: a miss
            self._count_lookup(key, entry, None)
            out.append(None if entry is None else entry.tensor)
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
            return _Entry(tensor, cost, tensor.numel() * tensor.element_size())

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

    def _expiry(self, key: StoreKey) -> int:
        """The expiry to write into ``key``'s header and TTL index; 0 for kinds without TTL."""
        ttl = self.policy(key).ttl_s
        return 0 if ttl is None else now_ms() + int(ttl * 1000)

    def _index_ttl(self, keys: list[StoreKey], expires_at_ms: int) -> Future[None] | None:
        """Start the TTL index write of ``keys`` (a Redis round trip), to run while their entries
        are sent. Indexing first is safe: the sweep only removes entries already expired, and an
        index row whose put failed names nothing to remove."""
        if not expires_at_ms:
            return None
        return self._io.submit(self.ttl_index.add, keys, expires_at_ms)

    def _after_write(self, written: Sequence[tuple[StoreKey, int]],
                     indexed: Future[None] | None) -> None:
        """Wait for the TTL index write; count each entry's payload bytes under its tenant."""
        if indexed is not None:
            indexed.result()
        for key, payload_bytes in written:
            self.counters.queue(key.tenant, key.kind,
                                {Event.BYTES_WRITTEN: float(payload_bytes)})

    @staticmethod
    def _seal(buf: RegisteredBuffer, offset: int, spec: TensorSpec, cost_us: int,
              expires_at_ms: int, layout: codec.Layout | None = None) -> None:
        """Write the header of the entry at ``offset`` of ``buf``, whose payload is in place."""
        view = buf.memoryview()[offset:offset + spec.entry_bytes]
        checksum = codec.checksum(view[spec.header_bytes:])
        if layout is None:
            codec.write_header(view, spec, checksum=checksum, cost_us=cost_us,
                               expires_at_ms=expires_at_ms)
        else:
            layout.write(view, checksum=checksum, cost_us=cost_us, expires_at_ms=expires_at_ms)

    def _store_entry(self, key: StoreKey, slot: TensorSlot, cost_us: int,
                     expires_at_ms: int) -> None:
        """Seal and send the entry laid out in ``slot``; a key that exists (or that another
        writer holds) is left to the first writer."""
        name, buf, spec = str(key), slot.buffer, slot.spec
        size, config = spec.entry_bytes, self._config(key)
        # Sealed before the first wait, while the payload the caller just wrote is in cache.
        self._seal(buf, 0, spec, cost_us, expires_at_ms, slot.layout)
        if size < PUT_SESSION_MIN_BYTES:
            self.store.put_from(name, buf.ptr, size, config)
            return
        if not self.store.begin_put(name, size, config):
            return
        try:
            self.store.put_range(name, buf.ptr, size, 0)
            self.store.end_put(name)
        except BaseException:
            self._revoke(key, name)
            raise

    def _revoke(self, key: StoreKey, name: str) -> None:
        """Drop an unfinished put: ending a session that missed a range would publish bytes
        never written."""
        try:
            self.store.revoke_put(name)
        except CacheError as exc:
            log.warning("could not revoke the unfinished put of %s: %s", key, exc)

    def _fetch(self, key: StoreKey) -> _Entry | None:
        """A verified copy of the entry, or None; counts nothing but corruption and expiry."""
        with self._pool.lease(self._pool.slab_bytes) as buf:
            try:
                size = self._call(key, lambda: self.store.get_into(str(key), buf.ptr,
                                                                   buf.capacity))
            except EntryTooLargeError:
                size = None
            else:
                return None if size is None else self._open(key, buf, 0, size, copy=True)
        # Larger than a slab: learn its size and read it into a buffer of its own.
        entry_bytes = self._call(key, lambda: self.store.size_of(str(key)))
        if entry_bytes is None:
            return None
        with self._pool.lease(entry_bytes) as big:
            entry = self._read(key, big, entry_bytes)
            return None if entry is None else entry.cloned()

    def _read(self, key: StoreKey, buf: RegisteredBuffer, expected: int | None,
              slot: TensorSlot | None = None) -> _Entry | None:
        """The verified entry, landed at the start of ``buf``, or None. ``expected`` is the
        entry size the caller expects, if it knows one; ``slot`` its spec, if it has one."""
        if expected is not None and SESSION_MIN_BYTES <= expected <= buf.capacity:
            layout = None if slot is None else slot.layout
            try:
                read = self._call(key, lambda: self._read_ranges(str(key), buf, expected, layout))
            except CodecError as exc:
                self._discard(key, Event.CORRUPT, exc)
                return None
            if read is _Read.MISS:
                return None
            if read is not _Read.OTHER_SIZE:
                # The slot's layout returns the slot's own spec: its view is the entry's.
                view = slot.tensor if slot is not None and read.spec is slot.spec else None
                return self._admit(key, buf, 0, read, view)
        size = self._call(key, lambda: self.store.get_into(str(key), buf.ptr, buf.capacity))
        if size is None:
            return None
        if slot is not None and size == expected:
            received = buf.memoryview(size)
            header = slot.layout.header(received)
            if header is not None:
                if codec.checksum(received[header.size:]) != header.checksum:
                    self._discard(key, Event.CORRUPT, CodecError("payload checksum mismatch"))
                    return None
                return self._admit(key, buf, 0, header, slot.tensor)
        return self._open(key, buf, 0, size)

    def _read_ranges(self, name: str, buf: RegisteredBuffer, size: int,
                     layout: codec.Layout | None) -> Header | _Read:
        """Read and verify an entry of ``size`` bytes through a get session; raises
        CodecError for a corrupt one."""
        pieces = -(-size // READ_PIECE_BYTES)  # worked out before the waits, while warm
        bounds = [size * i // pieces for i in range(pieces + 1)]
        if not self.store.begin_get(name):
            return _Read.MISS
        try:
            return self._receive(name, buf, bounds, layout)
        finally:
            self.store.end_get(name)

    def _receive(self, name: str, buf: RegisteredBuffer, bounds: list[int],
                 layout: codec.Layout | None) -> Header | _Read:
        size = bounds[-1]
        view = buf.memoryview(size)
        header: Header | None = None
        payload_sum = codec.Checksum() if len(bounds) > 2 else None
        for lo, hi in itertools.pairwise(bounds):
            if not self.store.get_range(name, buf.ptr + lo, hi - lo, lo):
                return _Read.OTHER_SIZE
            if header is None:
                header = None if layout is None else layout.header(view)
                if header is None:  # not the layout expected: tell another spec from junk
                    header = codec.parse_header(view[:hi])
                    if header.entry_bytes != size:
                        return _Read.OTHER_SIZE
            if payload_sum is not None:
                payload_sum.update(view[max(lo, header.size):hi])
        assert header is not None  # an entry is never empty: it holds at least a header
        received = (codec.checksum(view[header.size:]) if payload_sum is None
                    else payload_sum.value)
        if received != header.checksum:
            raise CodecError("payload checksum mismatch")
        return header

    def _open(self, key: StoreKey, buf: RegisteredBuffer, offset: int, size: int, *,
              copy: bool = False) -> _Entry | None:
        """Verify the entry of ``size`` bytes at ``offset``: a view of it, or with ``copy`` a
        copy, taken after the checksum (which leaves the bytes in cache for it)."""
        view = buf.memoryview()[offset:offset + size]
        try:
            header = codec.read_header(view, size)
            if codec.checksum(view[header.size:]) != header.checksum:
                raise CodecError("payload checksum mismatch")
        except CodecError as exc:
            self._discard(key, Event.CORRUPT, exc)
            return None
        entry = self._admit(key, buf, offset, header)
        return entry.cloned() if entry is not None and copy else entry

    def _admit(self, key: StoreKey, buf: RegisteredBuffer, offset: int, header: Header,
               view: torch.Tensor | None = None) -> _Entry | None:
        """The verified entry at ``offset`` as a view (``view`` when the caller has made it),
        unless it has expired."""
        if _expired(header):
            self._discard(key, Event.EXPIRED, None)
            return None
        if view is None:
            view = codec.typed_view(buf.raw, offset + header.size, header.spec)
        return _Entry(view, header.cost_us / 1e6, header.payload_bytes)

    def _discard(self, key: StoreKey, event: Event, error: CodecError | None) -> None:
        """Count and remove a corrupt or expired entry; the read is a miss."""
        if error is not None:
            log.error("removing corrupt cache entry %s: %s", key, error)
        self.counters.add(key.tenant, key.kind, event)
        self.remove(key)

    def _count_read(self, key: StoreKey, entry: _Entry | None, saved_s: float | None,
                    lookup: bool) -> None:
        if not lookup:
            if entry is not None:
                self.counters.queue(key.tenant, key.kind, {Event.BYTES_READ: float(entry.nbytes)})
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
                Event.BYTES_READ: float(entry.nbytes),
                Event.COMPUTE_SECONDS_SAVED: entry.cost_s if saved_s is None else saved_s,
            }
        self.counters.queue(key.tenant, key.kind, events)

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


def _expired(header: Header) -> bool:
    return bool(header.expires_at_ms) and header.expires_at_ms <= now_ms()


def _offsets(specs: Sequence[TensorSpec]) -> list[int]:
    return _offsets_of([s.entry_bytes for s in specs])


def _offsets_of(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive, aligned entries, plus the total size as the last item."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + -(-size // codec.ALIGN) * codec.ALIGN)
    return out
