"""One entry's bytes on their way to and from the store: sealed with its header, sent in one
call or through a put session, verified when read, and counted and removed when corrupt or
expired. Bytes and addresses only, no tensors: the tensor cache and the byte entries share it."""

from __future__ import annotations

import logging

from cachesvc import codec
from cachesvc.codec import Header, TensorSpec
from cachesvc.counted_store import CountedStore
from cachesvc.counters import CacheCounters, Event
from cachesvc.errors import CacheError, CodecError
from cachesvc.store_backend import StoreBackend
from cachesvc.ttl_index import now_ms
from keys import StoreKey

log = logging.getLogger(__name__)

# From this size up an entry is written through a put session, whose wait sleeps: put_from
# spins while it waits, which on a machine short of cores takes a core from the transfer itself.
# Reads move to sessions from a smaller size (entry_reader.SESSION_MIN_BYTES): a write hashes
# its payload before it sends either way, so only the spinning is saved.
PUT_SESSION_MIN_BYTES = 4 << 20


def seal(view: memoryview, spec: TensorSpec, cost_us: int, expires_at_ms: int,
         layout: codec.Layout | None = None) -> None:
    """Write the header of the entry of ``spec`` at the start of ``view``, whose payload is in
    place; ``layout`` (the spec's) writes it faster."""
    checksum = codec.checksum(view[spec.header_bytes:spec.entry_bytes])
    if layout is None:
        codec.write_header(view, spec, checksum=checksum, cost_us=cost_us,
                           expires_at_ms=expires_at_ms)
    else:
        layout.write(view, checksum=checksum, cost_us=cost_us, expires_at_ms=expires_at_ms)


def send(store: StoreBackend, name: str, ptr: int, size: int, config: object) -> None:
    """Send the sealed entry of ``size`` bytes at ``ptr`` (registered memory); a key that
    exists, or that another writer holds, is left to the first writer."""
    if size < PUT_SESSION_MIN_BYTES:
        store.put_from(name, ptr, size, config)
        return
    if not store.begin_put(name, size, config):
        return
    try:
        store.put_range(name, ptr, size, 0)
        store.end_put(name)
    except BaseException:
        # Ending a session that missed a range would publish bytes never written.
        try:
            store.revoke_put(name)
        except CacheError as exc:
            log.warning("could not revoke the unfinished put of %s: %s", name, exc)
        raise


def verified(view: memoryview) -> Header:
    """The header of the whole entry in ``view``, its payload checked; CodecError if not."""
    header = codec.read_header(view, len(view))
    if codec.checksum(view[header.size:]) != header.checksum:
        raise CodecError("payload checksum mismatch")
    return header


def expired(header: Header) -> bool:
    """Whether the entry of ``header`` is past the expiry it was written with."""
    return bool(header.expires_at_ms) and header.expires_at_ms <= now_ms()


def discard(store: CountedStore, counters: CacheCounters, key: StoreKey, event: Event,
            error: CodecError | None) -> None:
    """Count and remove a corrupt or expired entry; the read that found it is a miss."""
    if error is not None:
        log.error("removing corrupt cache entry %s: %s", key, error)
    counters.add(key.tenant, key.kind, event)
    store.remove(key)
