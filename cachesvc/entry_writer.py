"""Writing entries: each is sealed (header and payload checksum) in registered memory and sent
in one call, or from 4 MiB up through a put session; its expiry is indexed while it travels, and
a batch of smaller entries travels in one call."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from cachesvc import entry_io
from cachesvc.buffers import BufferPool, TensorSlot, packed_offsets
from cachesvc.codec import TensorSpec
from cachesvc.counted_store import CountedStore
from cachesvc.counters import Event, QueuedCounters
from cachesvc.entry_io import seal, send
from cachesvc.lookup_log import Access, LookupLog
from cachesvc.policy import KindPolicy
from cachesvc.tensor_view import typed_view
from cachesvc.ttl_index import TtlIndex, now_ms
from cachesvc.value_index import ValueIndex
from keys import KeyKind, StoreKey

# Threads for the TTL index writes (a Redis round trip each) that run while entries are sent.
IO_THREADS = 2


class EntryWriter:
    """Sealed writes to ``store`` from ``pool``'s registered buffers, with each kind's expiry
    and replication from ``policies``; ``counters`` count the payload bytes written,
    ``values`` record each entry's size and cost, and ``lookups``, where kept, log them."""

    def __init__(self, store: CountedStore, pool: BufferPool,
                 policies: Mapping[KeyKind, KindPolicy], ttl_index: TtlIndex,
                 counters: QueuedCounters, values: ValueIndex,
                 lookups: LookupLog | None = None) -> None:
        self._store = store
        self._pool = pool
        self._policies = policies
        self._ttl_index = ttl_index
        self._counters = counters
        self._values = values
        self._lookups = lookups
        self._configs = {pin: store.store.put_config(soft_pin=pin) for pin in (False, True)}
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="cache-io")

    def close(self) -> None:
        self._io.shutdown()

    @contextmanager
    def slot(self, spec: TensorSpec) -> Iterator[TensorSlot]:
        """Registered memory for one entry of ``spec``, for the zero-copy ``put_from``."""
        with self._pool.lease(spec.entry_bytes) as buf:
            yield TensorSlot(buf, spec)

    def put_from(self, key: StoreKey, slot: TensorSlot, cost_s: float) -> None:
        """Store the entry laid out in ``slot``; ``cost_s`` is what computing it took."""
        expires_at_ms = self._expiry(key)
        indexed = self._index_ttl([key], expires_at_ms)
        sent_at = time.time()
        self._store.write(key, lambda: self._send(key, slot, int(cost_s * 1e6), expires_at_ms))
        self._after_write([(key, slot.spec, cost_s)], indexed, sent_at)

    def put(self, key: StoreKey, tensor: torch.Tensor, cost_s: float) -> None:
        """Store a copy of ``tensor``."""
        with self.slot(TensorSpec.of(tensor)) as slot:
            slot.tensor.copy_(tensor)
            self.put_from(key, slot, cost_s)

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor]],
                 costs: Sequence[float]) -> None:
        """Store several tensors of one kind's policy, those under
        ``entry_io.PUT_SESSION_MIN_BYTES`` in one call."""
        specs = [TensorSpec.of(t) for _, t in items]
        small = [i for i, spec in enumerate(specs)
                 if spec.entry_bytes < entry_io.PUT_SESSION_MIN_BYTES]
        if len(small) < len(items):
            # Large entries go one by one through a put session, which waits by sleeping
            # (see entry_io.PUT_SESSION_MIN_BYTES); the rest still travel together.
            for i in sorted(set(range(len(items))) - set(small)):
                self.put(items[i][0], items[i][1], costs[i])
            items, specs, costs = ([items[i] for i in small], [specs[i] for i in small],
                                   [costs[i] for i in small])
        if not items:
            return
        offsets = packed_offsets([s.entry_bytes for s in specs])
        keys = [k for k, _ in items]
        config = self._config(keys[0])
        expires_at_ms = self._expiry(keys[0])
        indexed = self._index_ttl(keys, expires_at_ms)
        raw = self._store.store
        sent_at = time.time()
        with self._pool.lease(offsets[-1]) as buf:
            for (_, tensor), spec, off, cost in zip(items, specs, offsets[:-1], costs,
                                                    strict=True):
                typed_view(buf.raw, off + spec.header_bytes, spec).copy_(tensor)
                seal(buf.memoryview()[off:off + spec.entry_bytes], spec, int(cost * 1e6),
                     expires_at_ms)
            self._store.write(keys[0], lambda: raw.batch_put_from(
                [str(k) for k in keys], [buf.ptr + o for o in offsets[:-1]],
                [s.entry_bytes for s in specs], config))
        self._after_write(list(zip(keys, specs, costs, strict=True)), indexed, sent_at)

    def _config(self, key: StoreKey) -> object:
        return self._configs[self._policies[key.kind].soft_pin]

    def _expiry(self, key: StoreKey) -> int:
        return self._policies[key.kind].expiry_ms(now_ms())

    def _index_ttl(self, keys: list[StoreKey], expires_at_ms: int) -> Future[None] | None:
        """Start the TTL index write of ``keys`` (a Redis round trip), to run while their entries
        are sent. Indexing first is safe: the sweep only removes entries already expired, and an
        index row whose put failed names nothing to remove."""
        if not expires_at_ms:
            return None
        return self._io.submit(self._ttl_index.add, keys, expires_at_ms)

    def _after_write(self, written: Sequence[tuple[StoreKey, TensorSpec, float]],
                     indexed: Future[None] | None, sent_at: float) -> None:
        """Wait for the TTL index write; count each entry's payload bytes under its tenant,
        queue its value record and log it as written when it was sent (``sent_at``), before
        any reader could have found it."""
        if indexed is not None:
            indexed.result()
        for key, spec, cost_s in written:
            self._counters.queue(key.tenant, key.kind,
                                 {Event.BYTES_WRITTEN: float(spec.payload_bytes)})
            self._values.written(key, spec.entry_bytes, cost_s)
            if self._lookups is not None:
                self._lookups.log(Access.WRITE, key, spec.entry_bytes, cost_s, at=sent_at)

    def _send(self, key: StoreKey, slot: TensorSlot, cost_us: int, expires_at_ms: int) -> None:
        """Seal and send the entry laid out in ``slot``."""
        buf, spec = slot.buffer, slot.spec
        # Sealed before the first wait, while the payload the caller just wrote is in cache.
        seal(buf.memoryview(spec.entry_bytes), spec, cost_us, expires_at_ms, slot.layout)
        send(self._store.store, str(key), buf.ptr, spec.entry_bytes, self._config(key))
