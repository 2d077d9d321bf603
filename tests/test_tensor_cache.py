"""The tensor cache against a real Mooncake master, storage node and Valkey."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest
import redis
import torch

from cachesvc import codec, entry_io, entry_reader
from cachesvc.codec import TensorSpec
from cachesvc.entry_reader import SESSION_MIN_BYTES
from cachesvc.errors import StoreUnavailableError
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints, replicate_config
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import KeyKind, StoreKey
from tests.counting import counted
from workers.queue.record_write import tally_fields

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 4), (1, 2, 3, 2, 5)]
# Element counts (float32) on either side of the session threshold.
SMALL, LARGE = 100, SESSION_MIN_BYTES // 4 + 1000
_ids = itertools.count()


def sessions_for_large_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let LARGE entries be written through a session too, as entries of 4 MiB and more are."""
    monkeypatch.setattr(entry_io, "PUT_SESSION_MIN_BYTES", SESSION_MIN_BYTES)


@pytest.fixture(params=["one-call", "session", "pieces"])
def n(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The element count of a test entry, for each way an entry moves: a small one by
    put_from/get_into, a large one by sessions, and (read into a slot) in pieces, made small
    here so that a large entry arrives in five."""
    if request.param != "one-call":
        sessions_for_large_puts(monkeypatch)
    if request.param == "pieces":
        monkeypatch.setattr(entry_reader, "READ_PIECE_BYTES", 64 << 10)
    return SMALL if request.param == "one-call" else LARGE


def read_get(cache: TensorCache, k: StoreKey, spec: TensorSpec) -> torch.Tensor | None:
    return cache.get(k)


def read_batch_get(cache: TensorCache, k: StoreKey, spec: TensorSpec) -> torch.Tensor | None:
    return cache.batch_get([k])[0]


def read_into_buffer(cache: TensorCache, k: StoreKey, spec: TensorSpec) -> torch.Tensor | None:
    with cache.slot(spec) as target:
        view = cache.get_into(k, target.buffer)
        return None if view is None else view.clone()


def read_into_slot(cache: TensorCache, k: StoreKey, spec: TensorSpec) -> torch.Tensor | None:
    with cache.slot(spec) as target:
        view = cache.get_into(k, target)
        return None if view is None else view.clone()


READS = [read_get, read_batch_get, read_into_buffer, read_into_slot]


def key(kind: KeyKind = KeyKind.SCRATCH, tenant: str = "acme") -> StoreKey:
    return StoreKey(tenant, kind, f"k{next(_ids)}")


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_round_trip(cache: TensorCache, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    k, t = key(), sample(dtype, shape)
    cache.put(k, t)
    back = cache.get(k)
    assert back is not None and back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_non_contiguous_input_is_stored_as_its_values(cache: TensorCache) -> None:
    k, t = key(), torch.randn(4, 6).t()
    cache.put(k, t)
    assert torch.equal(cache.get(k), t)  # type: ignore[arg-type]


def test_miss_is_none_and_counted(cache: TensorCache, redis_client: redis.Redis) -> None:
    k = key(KeyKind.OUTPUT)
    assert cache.get(k) is None
    totals = counted(cache, redis_client, "acme")
    assert {f: totals.get(f, 0) for f in ("output.misses", "output.lookups")} == {
        "output.misses": 1, "output.lookups": 1}


def test_hit_counts_bytes_and_recorded_compute_seconds(cache: TensorCache,
                                                       redis_client: redis.Redis) -> None:
    k, t = key(KeyKind.EMBEDDING), torch.ones(256)
    cache.put(k, t, cost_s=0.25)
    cache.get(k)
    cache.get(k, saved_s=1.0)
    fields = counted(cache, redis_client, "acme")
    assert fields["embed.hits"] == 2
    assert fields["embed.bytes_read"] == 2 * 256 * 4
    assert fields["embed.bytes_written"] == 256 * 4
    assert fields["embed.compute_seconds_saved"] == pytest.approx(1.25)


def store_damaged(cache: TensorCache, k: StoreKey, t: torch.Tensor,
                  damage: Callable[[memoryview, TensorSpec], None]) -> None:
    """Store ``t`` as a well-formed entry, then change it as storage or a transfer might,
    bypassing the cache's write path."""
    spec = TensorSpec.of(t)
    with cache.slot(spec) as slot:
        slot.tensor.copy_(t)
        view = slot.buffer.memoryview(spec.entry_bytes)
        codec.write_header(view, spec, checksum=codec.checksum(view[spec.header_bytes:]),
                           cost_us=0, expires_at_ms=0)
        damage(view, spec)
        cache.store.put_from(str(k), slot.buffer.ptr, spec.entry_bytes,
                             replicate_config(soft_pin=False))


def first_payload_bit(view: memoryview, spec: TensorSpec) -> None:
    view[spec.header_bytes] ^= 1


def last_payload_bit(view: memoryview, spec: TensorSpec) -> None:
    view[spec.entry_bytes - 1] ^= 1


def checksum_field(view: memoryview, spec: TensorSpec) -> None:
    view[20] ^= 1  # the header's checksum, whose payload is intact


def magic(view: memoryview, spec: TensorSpec) -> None:
    view[0] ^= 0xFF


@pytest.mark.parametrize("read", READS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("damage", [first_payload_bit, last_payload_bit, checksum_field, magic],
                         ids=lambda f: f.__name__)
def test_corrupt_entry_is_counted_removed_and_missed(
        cache: TensorCache, redis_client: redis.Redis, n: int,
        damage: Callable[[memoryview, TensorSpec], None],
        read: Callable[[TensorCache, StoreKey, TensorSpec], torch.Tensor | None]) -> None:
    """Every read path verifies the header and the whole payload before it returns anything,
    whichever way the entry moved: in one call, in a session, or in pieces."""
    k, t = key(), torch.arange(n, dtype=torch.float32)
    store_damaged(cache, k, t, damage)
    assert cache.exists(k)
    assert read(cache, k, TensorSpec.of(t)) is None
    assert not cache.exists(k)
    assert counted(cache, redis_client, "acme").get("scratch.corrupt", 0) == 1


@pytest.mark.parametrize("read", READS, ids=lambda f: f.__name__)
def test_every_read_path_returns_what_every_write_path_stored(
        cache: TensorCache, n: int,
        read: Callable[[TensorCache, StoreKey, TensorSpec], torch.Tensor | None]) -> None:
    single, batched, t = key(), key(), torch.randn(n)
    cache.put(single, t)
    cache.batch_put([(batched, t)])
    for k in (single, batched):
        back = read(cache, k, TensorSpec.of(t))
        assert back is not None and torch.equal(back, t)


@pytest.mark.parametrize("stored", [
    torch.randn(LARGE + 16),  # the entry is longer than the slot expects
    torch.randn(LARGE - 16),  # shorter
    torch.arange(LARGE, dtype=torch.int32),  # as long, of another dtype
], ids=["longer", "shorter", "other-dtype"])
def test_a_slot_of_another_spec_gets_the_entry_as_it_is(
        cache: TensorCache, redis_client: redis.Redis, stored: torch.Tensor) -> None:
    """A slot sizes the read; it does not decide what the entry is. A valid entry of another
    spec is read whole, verified and returned, and is not taken for corrupt."""
    k = key()
    cache.put(k, stored)
    with cache.slot(TensorSpec("float32", (LARGE,))) as target:
        view = cache.get_into(k, target)
        assert view is not None and view.dtype == stored.dtype and torch.equal(view, stored)
    assert cache.exists(k)
    assert counted(cache, redis_client, "acme").get("scratch.corrupt", 0) == 0


def test_a_put_that_fails_midway_publishes_nothing(cache: TensorCache,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A session whose transfer failed is revoked, never ended: ending it would publish the
    bytes that were not written, and would keep the key from a later writer."""
    k, t = key(), torch.randn(LARGE)
    transfer = cache.store.put_range
    failed: list[str] = []

    def fails_once(name: str, ptr: int, size: int, offset: int) -> None:
        if not failed:
            failed.append(name)
            raise StoreUnavailableError("the storage node did not answer", key=name, op="put")
        transfer(name, ptr, size, offset)

    sessions_for_large_puts(monkeypatch)
    monkeypatch.setattr(cache.store, "put_range", fails_once)
    with pytest.raises(StoreUnavailableError):
        cache.put(k, t)
    assert failed == [str(k)] and not cache.exists(k)
    cache.put(k, t)  # through a session again: the revoked key is free
    assert torch.equal(cache.get(k), t)  # type: ignore[arg-type]


def test_ttl_expiry_on_read_and_by_sweep(stack_settings: Settings, cache: TensorCache,
                                        redis_client: redis.Redis) -> None:
    short = stack_settings.cache.model_copy(update={"output_ttl_s": 0.3})
    endpoints = StoreEndpoints.configured(stack_settings.store)
    ttl_cache = TensorCache(MooncakeStore.connect(endpoints, stack_settings.store),
                            redis_client, short, stack_settings.store)
    try:
        read_me, never_read, pinned = key(KeyKind.OUTPUT), key(KeyKind.OUTPUT), key(
            KeyKind.EMBEDDING)
        for k in (read_me, never_read, pinned):
            ttl_cache.put(k, torch.ones(4))
        large, large_spec = key(KeyKind.OUTPUT), TensorSpec("float32", (LARGE,))
        ttl_cache.put(large, torch.ones(LARGE))
        with ttl_cache.slot(large_spec) as target:
            assert ttl_cache.get(read_me) is not None
            assert ttl_cache.get_into(large, target) is not None
            time.sleep(0.5)
            assert ttl_cache.get(read_me) is None and not ttl_cache.exists(read_me)
            assert ttl_cache.get_into(large, target) is None and not ttl_cache.exists(large)
        assert ttl_cache.exists(never_read)
        assert ttl_cache.ttl_index.sweep(cache.store) == 1
        assert not ttl_cache.exists(never_read)
        assert ttl_cache.get(pinned) is not None  # embeddings have no TTL
    finally:
        ttl_cache.close()


def test_tenants_never_see_each_others_entries(cache: TensorCache) -> None:
    mine = StoreKey("acme", KeyKind.EMBEDDING, "same-content")
    theirs = StoreKey("globex", KeyKind.EMBEDDING, "same-content")
    cache.put(mine, torch.ones(3))
    assert cache.get(theirs) is None and not cache.exists(theirs)
    cache.put(theirs, torch.zeros(3))
    assert torch.equal(cache.get(mine), torch.ones(3))  # type: ignore[arg-type]


def test_content_keyed_writes_are_idempotent(cache: TensorCache) -> None:
    k = key(KeyKind.EMBEDDING)
    cache.put(k, torch.ones(3))
    cache.put(k, torch.ones(3))
    assert torch.equal(cache.get(k), torch.ones(3))  # type: ignore[arg-type]


def test_many_lookups_count_as_gets_and_a_batch_keeps_each_cost_and_tenant(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    """``lookup_many`` (the CFG tier's lookups of a step) counts each key as ``get`` would;
    ``batch_put`` of entries of two tenants records each one's cost and bytes under its own
    tenant (a step's checkpoints are of several requests)."""
    mine, theirs = key(KeyKind.CFG, "acme"), key(KeyKind.CFG, "other")
    cache.batch_put([(mine, torch.ones(4)), (theirs, torch.ones(8))], cost_s=[0.5, 2.0])
    found = cache.lookup_many([key(KeyKind.CFG, "acme"), mine, theirs])
    assert found[0] is None
    assert found[1] is not None and torch.equal(found[1], torch.ones(4))
    assert found[2] is not None and torch.equal(found[2], torch.ones(8))
    acme, other = (counted(cache, redis_client, t) for t in ("acme", "other"))
    assert {f: acme.get(f, 0) for f in ("cfg.lookups", "cfg.hits", "cfg.misses")} == {
        "cfg.lookups": 2, "cfg.hits": 1, "cfg.misses": 1}
    assert acme["cfg.compute_seconds_saved"] == pytest.approx(0.5)
    assert acme["cfg.bytes_written"] == 16 and other["cfg.bytes_written"] == 32
    assert other["cfg.compute_seconds_saved"] == pytest.approx(2.0)


def test_batch_operations(cache: TensorCache) -> None:
    ks = [key(KeyKind.EMBEDDING) for _ in range(3)]
    ts = [torch.randn(5), torch.randn(2, 3).to(torch.bfloat16), torch.arange(7)]
    cache.batch_put(list(zip(ks, ts, strict=True)))
    missing = key(KeyKind.EMBEDDING)
    assert cache.batch_exists([*ks, missing]) == [True, True, True, False]
    got = cache.batch_get([ks[2], missing, ks[0], ks[1]])
    assert got[1] is None
    for back, want in zip([got[2], got[3], got[0]], ts, strict=True):
        assert back is not None and torch.equal(back, want)
    twice = cache.batch_get([ks[0], ks[1], ks[0]])  # a prompt that is its own negative prompt
    assert all(t is not None for t in twice)
    assert torch.equal(twice[0], ts[0]) and torch.equal(twice[2], ts[0])  # type: ignore[arg-type]
    assert twice[0] is not twice[2]
    assert cache.exists(ks[0])  # and nothing was taken for corrupt


def test_zero_copy_put_from_and_get_into(cache: TensorCache, n: int) -> None:
    k, t = key(KeyKind.CHECKPOINT), torch.randn(n, 4)
    spec = TensorSpec.of(t)
    with cache.slot(spec) as slot:
        slot.tensor.copy_(t)
        cache.put_from(k, slot)
    with cache.slot(spec) as target:
        for into in (target.buffer, target):
            target.tensor.zero_()
            view = cache.get_into(k, into)
            assert view is not None and torch.equal(view, t)
            # A view into the caller's registered memory, not a copy.
            assert view.data_ptr() == target.buffer.ptr + spec.header_bytes


def test_entries_larger_than_a_slab(cache: TensorCache) -> None:
    k = key(KeyKind.OUTPUT)
    big = torch.randn((cache._pool.slab_bytes // 4) + 1000)
    cache.put(k, big)
    assert torch.equal(cache.get(k), big)  # type: ignore[arg-type]


def test_consume_deletes_single_consumer_entries(cache: TensorCache) -> None:
    k = key(KeyKind.LATENTS)
    cache.put(k, torch.ones(2))
    assert cache.consume(k) is not None
    assert not cache.exists(k) and cache.consume(k) is None
    with pytest.raises(ValueError, match="shared"):
        cache.consume(key(KeyKind.EMBEDDING))


def test_unpinned_entries_are_evicted_before_pinned(cache: TensorCache) -> None:
    """Fill the 128 MiB storage node to twice its size; soft-pinned embeddings survive."""
    block = torch.ones(1 << 20)  # 4 MiB
    pinned = [key(KeyKind.EMBEDDING) for _ in range(4)]
    for k in pinned:
        cache.put(k, block)
    unpinned = [key(KeyKind.SCRATCH) for _ in range(64)]
    for k in unpinned:
        cache.put(k, block)
    time.sleep(0.5)
    assert all(cache.exists(k) for k in pinned)
    assert sum(cache.exists(k) for k in unpinned) < len(unpinned) // 2


def test_handoff_reads_and_probes_count_what_they_are(cache: TensorCache,
                                                      redis_client: redis.Redis) -> None:
    """Hit rates measure reuse: a stage reading its input is not a lookup; a probe is."""
    handed, probed = key(KeyKind.LATENTS), key(KeyKind.OUTPUT)
    cache.put(handed, torch.ones(8))
    cache.get(handed, lookup=False)
    cache.batch_get([handed], lookup=False)
    cache.put(probed, torch.ones(2))
    assert cache.contains(probed) and not cache.contains(key(KeyKind.OUTPUT))
    fields = counted(cache, redis_client, "acme")
    assert "latents.lookups" not in fields and fields["latents.bytes_read"] == 2 * 8 * 4
    assert (fields["output.lookups"], fields["output.hits"], fields["output.misses"]) == (2, 1, 1)


def test_a_jobs_ledger_counts_each_lookup_once_into_the_counters_and_its_tally(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    """Every counted read, probe and batch lookup made with a job's ledger lands in the cache
    counters and in the ledger's tally alike (what the job writes to its record); a handoff
    read is no lookup in either; a take empties the tally, not the counters."""
    tenant = f"ledger-{next(_ids)}"
    ledger = cache.ledger(tenant)
    stored, absent = key(KeyKind.EMBEDDING, tenant), key(KeyKind.EMBEDDING, tenant)
    cache.put(stored, torch.ones(8), cost_s=0.5)
    assert cache.get(stored, ledger=ledger) is not None
    assert cache.get(absent, ledger=ledger) is None
    assert cache.contains(stored, ledger) and not cache.contains(absent, ledger)
    assert cache.get_or_compute(stored, lambda: torch.zeros(8), ledger).outcome is not None
    cfg = key(KeyKind.CFG, tenant)
    assert cache.lookup_many([cfg], [ledger]) == [None]
    cache.get(stored, lookup=False, ledger=ledger)  # a handoff: bytes, no lookup
    ledger.lookup(KeyKind.STEP, hit=True)  # a lookup that reads nothing
    taken = ledger.take()
    totals = counted(cache, redis_client, tenant)
    for kind in (KeyKind.EMBEDDING, KeyKind.CFG, KeyKind.STEP):
        assert (taken[kind].lookups, taken[kind].hits) == (
            totals[f"{kind.value}.lookups"], totals.get(f"{kind.value}.hits", 0)), kind
    assert (taken[KeyKind.EMBEDDING].lookups, taken[KeyKind.EMBEDDING].hits) == (5, 3)
    assert ledger.take() == {}
    with pytest.raises(ValueError, match="ledger of tenant"):  # another tenant's key
        cache.get(key(KeyKind.EMBEDDING, "acme"), ledger=ledger)
    # A kind a record always shows is written as 0 when nothing of it was looked up.
    assert tally_fields(ledger.take(), [KeyKind.CFG]).add == {"lookups:cfg": 0, "hits:cfg": 0}
