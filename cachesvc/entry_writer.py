"""Writing entries: each is sealed (header and payload checksum) in registered memory and sent
in one call, or from 4 MiB up through a put session; its expiry is indexed while it travels, and
a batch of smaller entries travels in one call."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from cachesvc import codec
from cachesvc.buffers import BufferPool, RegisteredBuffer, TensorSlot, packed_offsets
from cachesvc.codec import TensorSpec
from cachesvc.counted_store import CountedStore
from cachesvc.counters import Event, QueuedCounters
from cachesvc.errors import CacheError
from cachesvc.mooncake_store import replicate_config
from cachesvc.policy import KindPolicy
from cachesvc.ttl_index import TtlIndex, now_ms
from keys import KeyKind, StoreKey

log = logging.getLogger(__name__)

# From this size up an entry is written through a put session, whose wait sleeps: put_from
# spins while it waits, which on a machine short of cores takes a core from the transfer itself.
# Reads move to sessions from a smaller size (entry_reader.SESSION_MIN_BYTES): a write hashes
# its payload before it sends either way, so only the spinning is saved.
PUT_SESSION_MIN_BYTES = 4 << 20
# Threads for the TTL index writes (a Redis round trip each) that run while entries are sent.
IO_THREADS = 2


class EntryWriter:
    """Sealed writes to ``store`` from ``pool``'s registered buffers, with each kind's expiry
    and replication from ``policies``; ``counters`` count the payload bytes written."""

    def __init__(self, store: CountedStore, pool: BufferPool,
                 policies: Mapping[KeyKind, KindPolicy], ttl_index: TtlIndex,
                 counters: QueuedCounters) -> None:
        self._store = store
        self._pool = pool
        self._policies = policies
        self._ttl_index = ttl_index
        self._counters = counters
        self._configs = {pin: replicate_config(soft_pin=pin) for pin in (False, True)}
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
        self._store.write(key, lambda: self._send(key, slot, int(cost_s * 1e6), expires_at_ms))
        self._after_write([(key, slot.spec.payload_bytes)], indexed)

    def put(self, key: StoreKey, tensor: torch.Tensor, cost_s: float) -> None:
        """Store a copy of ``tensor``."""
        with self.slot(TensorSpec.of(tensor)) as slot:
            slot.tensor.copy_(tensor)
            self.put_from(key, slot, cost_s)

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor]],
                 costs: Sequence[float]) -> None:
        """Store several tensors of one kind's policy, those under PUT_SESSION_MIN_BYTES in
        one call."""
        specs = [TensorSpec.of(t) for _, t in items]
        small = [i for i, spec in enumerate(specs) if spec.entry_bytes < PUT_SESSION_MIN_BYTES]
        if len(small) < len(items):
            # Large entries go one by one through a put session, which waits by sleeping
            # (see PUT_SESSION_MIN_BYTES); the rest still travel together.
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
        with self._pool.lease(offsets[-1]) as buf:
            for (_, tensor), spec, off, cost in zip(items, specs, offsets[:-1], costs,
                                                    strict=True):
                codec.typed_view(buf.raw, off + spec.header_bytes, spec).copy_(tensor)
                _seal(buf, off, spec, int(cost * 1e6), expires_at_ms)
            self._store.write(keys[0], lambda: raw.batch_put_from(
                [str(k) for k in keys], [buf.ptr + o for o in offsets[:-1]],
                [s.entry_bytes for s in specs], config))
        self._after_write([(k, s.payload_bytes) for k, s in zip(keys, specs, strict=True)],
                          indexed)

    def _config(self, key: StoreKey) -> object:
        return self._configs[self._policies[key.kind].soft_pin]

    def _expiry(self, key: StoreKey) -> int:
        """The expiry to write into ``key``'s header and TTL index; 0 for kinds without TTL."""
        ttl = self._policies[key.kind].ttl_s
        return 0 if ttl is None else now_ms() + int(ttl * 1000)

    def _index_ttl(self, keys: list[StoreKey], expires_at_ms: int) -> Future[None] | None:
        """Start the TTL index write of ``keys`` (a Redis round trip), to run while their entries
        are sent. Indexing first is safe: the sweep only removes entries already expired, and an
        index row whose put failed names nothing to remove."""
        if not expires_at_ms:
            return None
        return self._io.submit(self._ttl_index.add, keys, expires_at_ms)

    def _after_write(self, written: Sequence[tuple[StoreKey, int]],
                     indexed: Future[None] | None) -> None:
        """Wait for the TTL index write; count each entry's payload bytes under its tenant."""
        if indexed is not None:
            indexed.result()
        for key, payload_bytes in written:
            self._counters.queue(key.tenant, key.kind,
                                 {Event.BYTES_WRITTEN: float(payload_bytes)})

    def _send(self, key: StoreKey, slot: TensorSlot, cost_us: int, expires_at_ms: int) -> None:
        """Seal and send the entry laid out in ``slot``; a key that exists (or that another
        writer holds) is left to the first writer."""
        name, buf, spec, raw = str(key), slot.buffer, slot.spec, self._store.store
        size, config = spec.entry_bytes, self._config(key)
        # Sealed before the first wait, while the payload the caller just wrote is in cache.
        _seal(buf, 0, spec, cost_us, expires_at_ms, slot.layout)
        if size < PUT_SESSION_MIN_BYTES:
            raw.put_from(name, buf.ptr, size, config)
            return
        if not raw.begin_put(name, size, config):
            return
        try:
            raw.put_range(name, buf.ptr, size, 0)
            raw.end_put(name)
        except BaseException:
            self._revoke(key, name)
            raise

    def _revoke(self, key: StoreKey, name: str) -> None:
        """Drop an unfinished put: ending a session that missed a range would publish bytes
        never written."""
        try:
            self._store.store.revoke_put(name)
        except CacheError as exc:
            log.warning("could not revoke the unfinished put of %s: %s", key, exc)


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
