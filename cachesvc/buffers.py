"""A pool of buffers registered with Mooncake, so the hot path never registers per call.

Transfers land in (or leave from) registered memory without an extra copy. Registering costs a
round of pinning and bookkeeping, so buffers are registered once and leased out. A request larger
than one slab gets a one-off buffer, registered for that lease alone and counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cachesvc import codec
from cachesvc.errors import CacheError
from cachesvc.store_backend import StoreBackend
from cachesvc.tensor_view import typed_view

log = logging.getLogger(__name__)


class RegisteredBuffer:
    """Registered memory viewed as a flat uint8 tensor and as a memoryview of the same bytes."""

    __slots__ = ("_view", "capacity", "ptr", "raw")

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw
        self.ptr = int(raw.data_ptr())
        self.capacity = int(raw.numel())
        self._view = raw.numpy().data.cast("B")

    def memoryview(self, size: int | None = None) -> memoryview:
        return self._view if size is None else self._view[:size]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Registered memory laid out as one entry of ``spec``: fill ``tensor`` in place, then
    ``put_from``; or ``get_into`` it, which returns ``tensor`` once the entry is verified."""

    buffer: RegisteredBuffer
    spec: codec.TensorSpec
    tensor: torch.Tensor = field(init=False, repr=False, compare=False)
    layout: codec.Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Made once, before any transfer: after a transfer's wait the same work runs cold.
        object.__setattr__(self, "tensor", typed_view(self.buffer.raw,
                                                            self.spec.header_bytes, self.spec))
        object.__setattr__(self, "layout", codec.Layout.of(self.spec))


class BufferPool:
    """Up to ``max_slabs`` registered slabs of ``slab_bytes``, created on first use."""

    def __init__(self, store: StoreBackend, slab_bytes: int, max_slabs: int) -> None:
        self._store = store
        self.slab_bytes = slab_bytes
        self._max_slabs = max_slabs
        self._free: list[RegisteredBuffer] = []
        self._all: list[RegisteredBuffer] = []
        self._cond = threading.Condition()
        self.oversize_leases = 0

    def _register(self, size: int) -> RegisteredBuffer:
        # Pinned where there is a GPU, so tensors cross between the device and the store by
        # DMA without a staging copy.
        raw = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        buf = RegisteredBuffer(raw)
        self._store.register(buf.ptr, buf.capacity)
        return buf

    @contextmanager
    def lease(self, size: int) -> Iterator[RegisteredBuffer]:
        """A registered buffer of at least ``size`` bytes for the duration of the block."""
        if size > self.slab_bytes:
            with self._cond:
                self.oversize_leases += 1
            buf = self._register(size)
            try:
                yield buf
            finally:
                self._store.unregister(buf.ptr)
            return
        with self._cond:
            while not self._free and len(self._all) >= self._max_slabs:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                buf = self._register(self.slab_bytes)
                self._all.append(buf)
        try:
            yield buf
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()

    def close(self) -> None:
        """Unregister every slab; a store that is already gone only gets a warning."""
        with self._cond:
            for buf in self._all:
                try:
                    self._store.unregister(buf.ptr)
                except CacheError as exc:
                    log.warning("could not unregister a buffer at close: %s", exc)
            self._all.clear()
            self._free.clear()


def packed_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive, aligned entries of ``sizes`` in one buffer, plus the total
    size as the last item."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + -(-size // codec.ALIGN) * codec.ALIGN)
    return out
