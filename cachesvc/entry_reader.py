"""Reading entries back: into a caller's slot (sized from its spec, in pieces when large), into
a buffer without knowing the size, or several at once. Every entry is verified (header and the
whole payload's checksum) before it is returned; a corrupt or expired one is counted, removed
and read as a miss."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from cachesvc import codec
from cachesvc.buffers import BufferPool, RegisteredBuffer, TensorSlot, packed_offsets
from cachesvc.codec import Header
from cachesvc.counted_store import CountedStore
from cachesvc.counters import CacheCounters, Event
from cachesvc.entry_io import discard, expired, verified
from cachesvc.errors import CodecError, EntryTooLargeError
from cachesvc.tensor_view import typed_view
from keys import StoreKey

# From this size up an entry moves through a get session and ranged transfers, whose wait
# sleeps: get_into spins while it waits, which on a machine short of cores takes a core from the
# transfer itself, and leaves the bytes it received in another core's cache, where the checksum
# then reads them at a fraction of its speed. Below it the one-call form answers sooner: a
# session's two or three waits each cost a wake-up.
SESSION_MIN_BYTES = 256 << 10
# A sized read of a larger entry arrives in pieces of at most this, each hashed as soon as it
# lands, while it is still in the last-level cache; hashed after the whole transfer, the first
# pieces of a large entry would be read back from memory, at a third of the speed.
READ_PIECE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    """A verified entry and the compute time it recorded, which a hit counts as saved."""

    tensor: torch.Tensor
    cost_s: float
    nbytes: int

    def cloned(self) -> Entry:
        return Entry(self.tensor.clone(), self.cost_s, self.nbytes)


class _Read(Enum):
    """How a sized read ended when it did not end with a verified header."""

    MISS = "miss"
    OTHER_SIZE = "other size"  # the entry is not the size the caller expected: read it whole


class EntryReader:
    """Verified reads from ``store`` through ``pool``'s registered buffers; ``counters`` count
    the entries found corrupt or expired."""

    def __init__(self, store: CountedStore, pool: BufferPool, counters: CacheCounters) -> None:
        self._store = store
        self._pool = pool
        self._counters = counters

    def fetch(self, key: StoreKey) -> Entry | None:
        """A verified copy of the entry, or None; counts nothing but corruption and expiry."""
        raw = self._store.store
        with self._pool.lease(self._pool.slab_bytes) as buf:
            try:
                size = self._store.call(key, lambda: raw.get_into(str(key), buf.ptr,
                                                                  buf.capacity))
            except EntryTooLargeError:
                size = None
            else:
                return None if size is None else self.open(key, buf, 0, size, copy=True)
        # Larger than a slab: learn its size and read it into a buffer of its own.
        entry_bytes = self._store.size_of(key)
        if entry_bytes is None:
            return None
        with self._pool.lease(entry_bytes) as big:
            entry = self.read(key, big, entry_bytes)
            return None if entry is None else entry.cloned()

    def fetch_many(self, keys: Sequence[StoreKey]) -> dict[StoreKey, Entry | None]:
        """Verified copies of several distinct entries in one data round trip; a key absent
        from the answer is a miss."""
        sizes = [self._store.size_of(k) for k in keys]
        present = [(k, s) for k, s in zip(keys, sizes, strict=True) if s is not None]
        found: dict[StoreKey, Entry | None] = {}
        if not present:
            return found
        offsets = packed_offsets([s for _, s in present])
        raw = self._store.store
        with self._pool.lease(offsets[-1]) as buf:
            got = self._store.call(present[0][0], lambda: raw.batch_get_into(
                [str(k) for k, _ in present], [buf.ptr + o for o in offsets[:-1]],
                [s for _, s in present]))
            for (key, _), off, n in zip(present, offsets, got, strict=False):
                found[key] = None if n is None else self.open(key, buf, off, n, copy=True)
        return found

    def read(self, key: StoreKey, buf: RegisteredBuffer, expected: int | None,
             slot: TensorSlot | None = None) -> Entry | None:
        """The verified entry, landed at the start of ``buf``, or None. ``expected`` is the
        entry size the caller expects, if it knows one; ``slot`` its spec, if it has one."""
        raw = self._store.store
        if expected is not None and SESSION_MIN_BYTES <= expected <= buf.capacity:
            layout = None if slot is None else slot.layout
            try:
                read = self._store.call(key, lambda: self._read_ranges(str(key), buf, expected,
                                                                       layout))
            except CodecError as exc:
                self._discard(key, Event.CORRUPT, exc)
                return None
            if read is _Read.MISS:
                return None
            if read is not _Read.OTHER_SIZE:
                # The slot's layout returns the slot's own spec: its view is the entry's.
                view = slot.tensor if slot is not None and read.spec is slot.spec else None
                return self._admit(key, buf, 0, read, view)
        size = self._store.call(key, lambda: raw.get_into(str(key), buf.ptr, buf.capacity))
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
        return self.open(key, buf, 0, size)

    def open(self, key: StoreKey, buf: RegisteredBuffer, offset: int, size: int, *,
             copy: bool = False) -> Entry | None:
        """Verify the entry of ``size`` bytes at ``offset``: a view of it, or with ``copy`` a
        copy, taken after the checksum (which leaves the bytes in cache for it)."""
        try:
            header = verified(buf.memoryview()[offset:offset + size])
        except CodecError as exc:
            self._discard(key, Event.CORRUPT, exc)
            return None
        entry = self._admit(key, buf, offset, header)
        return entry.cloned() if entry is not None and copy else entry

    def _read_ranges(self, name: str, buf: RegisteredBuffer, size: int,
                     layout: codec.Layout | None) -> Header | _Read:
        """Read and verify an entry of ``size`` bytes through a get session; raises
        CodecError for a corrupt one."""
        raw = self._store.store
        pieces = -(-size // READ_PIECE_BYTES)  # worked out before the waits, while warm
        bounds = [size * i // pieces for i in range(pieces + 1)]
        if not raw.begin_get(name):
            return _Read.MISS
        try:
            return self._receive(name, buf, bounds, layout)
        finally:
            raw.end_get(name)

    def _receive(self, name: str, buf: RegisteredBuffer, bounds: list[int],
                 layout: codec.Layout | None) -> Header | _Read:
        raw, size = self._store.store, bounds[-1]
        view = buf.memoryview(size)
        header: Header | None = None
        payload_sum = codec.Checksum() if len(bounds) > 2 else None
        for lo, hi in itertools.pairwise(bounds):
            if not raw.get_range(name, buf.ptr + lo, hi - lo, lo):
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

    def _admit(self, key: StoreKey, buf: RegisteredBuffer, offset: int, header: Header,
               view: torch.Tensor | None = None) -> Entry | None:
        """The verified entry at ``offset`` as a view (``view`` when the caller has made it),
        unless it has expired."""
        if expired(header):
            self._discard(key, Event.EXPIRED, None)
            return None
        if view is None:
            view = typed_view(buf.raw, offset + header.size, header.spec)
        return Entry(view, header.cost_us / 1e6, header.payload_bytes)

    def _discard(self, key: StoreKey, event: Event, error: CodecError | None) -> None:
        discard(self._store, self._counters, key, event, error)
