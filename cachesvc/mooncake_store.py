"""The thin, typed layer over Mooncake's Python client: connect, status codes, raw byte ops.

Mooncake reports outcomes as integer codes. This module maps them once: ``OBJECT_NOT_FOUND`` is a
miss, RPC failures raise ``StoreUnavailableError``, anything else raises ``StoreOperationError``.
Every call here blocks; async callers go through ``cachesvc.async_cache``.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cachesvc.errors import (
    EntryTooLargeError,
    StoreFullError,
    StoreOperationError,
    StoreUnavailableError,
)
from cachesvc.store_backend import Eviction
from config.settings import StoreSettings

OK = 0
NO_AVAILABLE_HANDLE = -200  # no segment has room for the entry
INVALID_PARAMS = -600  # among others: the buffer given to get_into is too small
# The entry is being written by another client (which may be paused or dead mid-put). A reader
# treats it as not there yet; a writer of the same key leaves it to the first writer, as it
# does for an entry that exists (keys name content, so both write the same bytes).
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
# A put session on a key another client has written, or is writing: the first writer wins.
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
# A read whose lease (store.lease_ttl_ms) ran out before its transfer completed: the reader
# was paused or starved past it (a long GC, swap, SIGSTOP), and the entry may have been
# removed or evicted meanwhile. The read is made again under a fresh lease; one that keeps
# expiring reads as a miss, which the caller recomputes, never as a failed attempt.
LEASE_EXPIRED = -707
LEASE_RETRIES = 3
# A storage node holding the replica did not answer the transfer: it died or restarts. The
# master forgets its segment within seconds, after which the key reads as a miss.
TRANSFER_FAIL = -800
# Mooncake groups transport and RPC failures in the -900 range (RPC_FAIL is -900).
_RPC_RANGE = range(-999, -899)


@dataclass(frozen=True, slots=True)
class StoreEndpoints:
    """Where the master and its HTTP metadata server listen, and (if known) the master's
    Prometheus endpoint, which tells a full store from one with no storage node."""

    master_address: str
    metadata_server: str
    metrics_url: str | None = None

    @classmethod
    def configured(cls, store: StoreSettings) -> StoreEndpoints:
        """The endpoints the settings name; StoreUnavailableError where they name none."""
        if not store.master_address or not store.metadata_server:
            raise StoreUnavailableError(
                "no store configured: run `diffcache up`, or set DIFFCACHE_STORE__MASTER_ADDRESS "
                "and DIFFCACHE_STORE__METADATA_SERVER", op="connect")
        return cls(store.master_address, store.metadata_server, store.master_metrics_url)


def mounted_bytes(metrics_url: str) -> int | None:
    """The memory every mounted storage node contributes, as the master reports it; None if
    the master does not answer."""
    import httpx

    try:
        text = httpx.get(metrics_url, timeout=2).text
    except httpx.HTTPError:
        return None
    found = re.search(r"^master_total_capacity_bytes (\S+)$", text, re.MULTILINE)
    return None if found is None else int(float(found.group(1)))


def check_code(code: int, *, op: str, key: str | None = None) -> int:
    """Return a non-negative ``code``; raise the typed error for a negative one."""
    if code >= 0:
        return code
    if code in _RPC_RANGE:
        raise StoreUnavailableError(f"store did not answer (code {code})", key=key, op=op)
    if code == TRANSFER_FAIL:
        raise StoreUnavailableError("the storage node holding the entry did not answer "
                                    f"(code {code})", key=key, op=op)
    if code == NO_AVAILABLE_HANDLE:
        raise StoreFullError("no segment has room for the entry", key=key, op=op)
    raise StoreOperationError("store refused the operation", code=code, key=key, op=op)


def _reachable(address: str, timeout_s: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeStore:
    """One process's connection to the store, as a client that contributes no memory."""

    def __init__(self, client: Any, endpoints: StoreEndpoints) -> None:
        self._client = client
        self.endpoints = endpoints

    @classmethod
    def connect(cls, endpoints: StoreEndpoints, settings: StoreSettings) -> MooncakeStore:
        """Connect with ``global_segment_size=0``: data lives on storage nodes and outlives us.

        The master is probed first because Mooncake's own setup waits about 90 s on a dead one.
        """
        meta = urlsplit(endpoints.metadata_server)
        for address in (endpoints.master_address, f"{meta.hostname}:{meta.port}"):
            if not _reachable(address, settings.connect_timeout_s):
                raise StoreUnavailableError(f"nothing answers at {address}", op="connect")
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        code = client.setup(
            settings.local_hostname,
            endpoints.metadata_server,
            0,  # global_segment_size: this process contributes no memory
            0,  # local_buffer_size: every transfer uses registered buffers
            settings.protocol,
            settings.rdma_devices,
            endpoints.master_address,
        )
        if code != OK:
            raise StoreUnavailableError(f"setup against {endpoints.master_address} failed "
                                        f"with code {code}", op="connect")
        return cls(client, endpoints)

    def close(self) -> None:
        self._client.close()

    def put_config(self, *, soft_pin: bool) -> Any:
        return replicate_config(soft_pin=soft_pin)

    def storage_mounted(self) -> bool | None:
        """From the master's metrics: whether any storage node has mounted memory."""
        url = self.endpoints.metrics_url
        mounted = None if url is None else mounted_bytes(url)
        return None if mounted is None else mounted > 0

    # Registered memory ------------------------------------------------------------------------

    def register(self, ptr: int, size: int) -> None:
        check_code(self._client.register_buffer(ptr, size), op="register_buffer")

    def unregister(self, ptr: int) -> None:
        check_code(self._client.unregister_buffer(ptr), op="unregister_buffer")

    # Single-key operations --------------------------------------------------------------------

    def put_from(self, key: str, ptr: int, size: int, config: Any) -> None:
        code = self._client.put_from(key, ptr, size, config)
        if code != REPLICA_IS_NOT_READY:
            check_code(code, op="put", key=key)

    def get_into(self, key: str, ptr: int, capacity: int) -> int | None:
        """Bytes read into the buffer, or None on a miss."""
        code = self._client.get_into(key, ptr, capacity)
        for _ in range(LEASE_RETRIES):
            if code != LEASE_EXPIRED:
                break
            code = self._client.get_into(key, ptr, capacity)
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, LEASE_EXPIRED):
            return None
        if code == INVALID_PARAMS:
            raise EntryTooLargeError(f"entry does not fit {capacity} bytes", key=key, op="get")
        return check_code(code, op="get", key=key)

    def size_of(self, key: str) -> int | None:
        code = self._client.get_size(key)
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return None
        return check_code(code, op="get_size", key=key)

    def exists(self, key: str) -> bool:
        return check_code(self._client.is_exist(key), op="exists", key=key) == 1

    def remove(self, key: str) -> bool:
        """Remove ``key`` even while a reader's lease is held; False if it was not there."""
        code = self._client.remove(key, True)
        if code == OBJECT_NOT_FOUND:
            return False
        check_code(code, op="remove", key=key)
        return True

    def evict(self, key: str) -> Eviction:
        code = self._client.remove(key, False)
        if code == OBJECT_NOT_FOUND:
            return Eviction.ABSENT
        if code in (OBJECT_HAS_LEASE, REPLICA_IS_NOT_READY):  # a read, or a write unfinished
            return Eviction.BUSY
        check_code(code, op="evict", key=key)
        return Eviction.REMOVED

    def remove_all(self) -> None:
        """Remove every entry: for tests and for operators resetting a stack."""
        check_code(self._client.remove_all(), op="remove_all")

    # Batched operations -----------------------------------------------------------------------

    def batch_exists(self, keys: list[str]) -> list[bool]:
        codes = self._client.batch_is_exist(keys)
        return [check_code(c, op="batch_exists", key=k) == 1 for k, c in zip(keys, codes,
                                                                            strict=True)]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int],
                       config: Any) -> None:
        codes = self._client.batch_put_from(keys, ptrs, sizes, config)
        for k, c in zip(keys, codes, strict=True):
            if c != REPLICA_IS_NOT_READY:
                check_code(c, op="batch_put", key=k)

    def batch_get_into(self, keys: list[str], ptrs: list[int],
                       capacities: list[int]) -> list[int | None]:
        codes = self._client.batch_get_into(keys, ptrs, capacities)
        expired = [i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
        if expired:  # read those again, each under a fresh lease
            codes = list(codes)
            for i in expired:
                codes[i] = self.get_into(keys[i], ptrs[i], capacities[i]) or OBJECT_NOT_FOUND
        return [None if c in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
                else check_code(c, op="batch_get", key=k) for k, c in zip(keys, codes, strict=True)]

    # Sessions and ranged transfers ------------------------------------------------------------
    # One master round trip opens a session; byte ranges then move without another. The caller's
    # wait for a range sleeps where put_from/get_into spin, which on a machine short of cores
    # leaves the core to the transfer itself.

    def begin_put(self, key: str, size: int, config: Any) -> bool:
        """Reserve ``size`` bytes for ``key``, unreadable until ``end_put``; False when the key
        exists or another writer (another client, or another thread here) holds it."""
        code = self._client.batch_put_session_start([key], [size], config)[0]
        # INVALID_PARAMS here means this process already has a session on the key: every
        # entry is at least a header long, so the size is never what is refused.
        if code in (OBJECT_ALREADY_EXISTS, REPLICA_IS_NOT_READY, INVALID_PARAMS):
            return False
        check_code(code, op="put", key=key)
        return True

    def put_range(self, key: str, ptr: int, size: int, offset: int) -> None:
        """Write ``size`` bytes from ``ptr`` at ``offset`` of a reserved entry."""
        code = self._client.batch_put_from_multi_buffer_ranges([key], [[ptr]], [[size]],
                                                               [[offset]])[0]
        if check_code(code, op="put", key=key) != size:
            raise StoreOperationError("short ranged write", code=code, key=key, op="put")

    def end_put(self, key: str) -> None:
        """Make a reserved entry readable. Mooncake does not check that every byte was
        written: the caller ends only a session whose ranges all succeeded."""
        check_code(self._client.batch_put_session_end([key])[0], op="put", key=key)

    def revoke_put(self, key: str) -> None:
        """Drop a reservation whose writes did not all succeed."""
        check_code(self._client.batch_put_session_revoke([key])[0], op="put", key=key)

    def begin_get(self, key: str) -> bool:
        """Look ``key`` up once and lease it for ranged reads until ``end_get``; False on a
        miss."""
        code = self._client.batch_get_session_start([key])[0]
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return False
        check_code(code, op="get", key=key)
        return True

    def get_range(self, key: str, ptr: int, size: int, offset: int) -> bool:
        """Read ``size`` bytes at ``offset`` of a leased entry into ``ptr``; False when the
        range is not inside the entry (or this process's session on it has ended)."""
        code = self._client.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[size]],
                                                               [[offset]])[0]
        if code in (INVALID_PARAMS, LEASE_EXPIRED):  # either way the session is over
            return False
        if check_code(code, op="get", key=key) != size:
            raise StoreOperationError("short ranged read", code=code, key=key, op="get")
        return True

    def end_get(self, key: str) -> None:
        """Release the lease of ``begin_get``; local, and it never fails the read."""
        self._client.batch_get_session_end([key])


def replicate_config(*, soft_pin: bool) -> Any:
    """Mooncake's per-put options: soft-pinned entries are evicted only after unpinned ones."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.replica_num = 1
    if soft_pin:
        config.soft_pin_action = SoftPinAction.ENABLE
    return config
