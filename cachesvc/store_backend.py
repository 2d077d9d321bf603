"""What the cache asks of a store: registered memory, whole entries and byte ranges moved by
key, and existence, size and removal. Mooncake (``mooncake_store.py``) is the backend; the
cache above (reader, writer, byte entries, TTL sweep) is typed against this alone."""

from __future__ import annotations

from enum import Enum
from typing import Protocol


class Eviction(Enum):
    """What a removal that respects readers did."""

    REMOVED = "removed"
    ABSENT = "absent"  # already gone: evicted by the store, expired, or never written
    BUSY = "busy"  # a reader holds the entry's lease, or its write is unfinished: kept


class StoreBackend(Protocol):
    """A key-value store of byte entries that moves data to and from registered memory.
    A miss is None or False, never an exception; an unreachable store raises
    StoreUnavailableError and a full one StoreFullError (``cachesvc.errors``)."""

    def close(self) -> None: ...

    # Memory transfers read into or write from: registered once, used many times.
    def register(self, ptr: int, size: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def put_config(self, *, soft_pin: bool) -> object:
        """The options of a put: a soft-pinned entry is evicted after every unpinned one."""
        ...

    # Whole entries. A put of a key that exists leaves the first writer's entry.
    def put_from(self, key: str, ptr: int, size: int, config: object) -> None: ...

    def get_into(self, key: str, ptr: int, capacity: int) -> int | None:
        """Bytes read; EntryTooLargeError when the entry is larger than ``capacity``."""
        ...

    def size_of(self, key: str) -> int | None: ...

    def exists(self, key: str) -> bool: ...

    def remove(self, key: str) -> bool: ...

    def evict(self, key: str) -> Eviction:
        """Remove ``key`` unless a read holds its lease (``store.lease_ttl_ms``) or its write
        is unfinished."""
        ...

    def remove_all(self) -> None: ...

    def batch_exists(self, keys: list[str]) -> list[bool]: ...

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int],
                       config: object) -> None: ...

    def batch_get_into(self, keys: list[str], ptrs: list[int],
                       capacities: list[int]) -> list[int | None]: ...

    # Sessions: an entry reserved, written in ranges and then published (or revoked); an entry
    # leased and read in ranges. A waiting caller sleeps instead of spinning.
    def begin_put(self, key: str, size: int, config: object) -> bool: ...

    def put_range(self, key: str, ptr: int, size: int, offset: int) -> None: ...

    def end_put(self, key: str) -> None: ...

    def revoke_put(self, key: str) -> None: ...

    def begin_get(self, key: str) -> bool: ...

    def get_range(self, key: str, ptr: int, size: int, offset: int) -> bool: ...

    def end_get(self, key: str) -> None: ...

    def storage_mounted(self) -> bool | None:
        """Whether any storage node holds memory for entries; None when the store cannot
        say. A put to a store without one fails as a put to a full store does."""
        ...
