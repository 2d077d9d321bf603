"""Eviction by value against the real store and Redis: the entries worth least per byte go
first, a read's lease keeps its entry, a tenant beyond its share loses its own entries first,
an input a request in flight holds is kept (until it ends), and an entry the store dropped by
itself is forgotten and counted."""

from __future__ import annotations

import time

import pydantic
import pytest
import redis
import torch

from cachesvc.counters import read_totals
from cachesvc.tensor_cache import TensorCache
from cachesvc.value_index import drop_holds, held, held_inputs, hold, read_clock, records
from cachesvc.value_sweep import Ended, ValueSweeper
from config.settings import CacheSettings, Settings
from keys import GenerationSpec, KeyKind, OutputFormat, StoreKey
from keys.names import request_record, ttl_index, value_keys
from workers.queue.records import Records, initial_fields
from workers.queue.schema import timestamp
from workers.queue.script_args import CancelArgs
from workers.queue.scripts import Scripts

FLOATS = 1024  # each entry: 4 KiB of payload and its header


def write(cache: TensorCache, tenant: str, name: str, cost_s: float) -> StoreKey:
    key = StoreKey(tenant, KeyKind.OUTPUT, name)
    cache.put(key, torch.zeros(FLOATS), cost_s=cost_s)
    return key


def sweeper(cache: TensorCache, client: redis.Redis, settings: Settings,
            keys: list[StoreKey], fill: float, ended: Ended | None = None,
            **cache_settings: float) -> ValueSweeper:
    """A sweeper whose capacity ``keys``' entries fill to ``fill``, once their values are
    recorded."""
    cache.counters.flush()
    sizes = [r.size for r in records(client, keys[0].tenant, keys) if r is not None]
    assert len(sizes) == len(keys)  # every entry recorded
    total = sizes[0] * len(keys)
    return ValueSweeper(client, cache.store, cache.counters, int(total / fill),
                        settings.cache.model_copy(update=cache_settings), ended)


def present(cache: TensorCache, keys: list[StoreKey]) -> list[bool]:
    return cache.batch_exists(keys)


def test_the_entries_worth_least_per_byte_go_first(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    cheap, dear, read = (write(cache, "value", name, cost) for name, cost in
                         (("cheap", 0.1), ("dear", 1.0), ("read", 0.1)))
    for _ in range(5):
        assert cache.get(read) is not None  # reads raise its priority above ``cheap``'s
    keys = [cheap, dear, read]
    # 3 entries at 0.9 of capacity, above 0.85: down to 0.75 takes one entry.
    report = sweeper(cache, redis_client, stack_settings, keys, 0.9).sweep()
    assert present(cache, keys) == [False, True, True]
    assert (report.evicted, report.found_gone, report.busy) == (1, 0, 0)
    assert report.held_after == report.held_before * 2 // 3
    assert records(redis_client, "value", keys)[0] is None  # forgotten with its entry
    assert records(redis_client, "value", [read])[0].reads == 5  # type: ignore[union-attr]
    assert held(redis_client, "value") == {KeyKind.OUTPUT: report.held_after}
    cache.counters.flush()
    assert read_totals(redis_client, "value")["output.evictions"] == 1


def test_below_the_watermark_nothing_is_removed(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    keys = [write(cache, "value", f"e{i}", 0.1) for i in range(3)]
    report = sweeper(cache, redis_client, stack_settings, keys, 0.8).sweep()
    assert report.evicted == 0 and all(present(cache, keys))


def test_an_entry_under_a_read_is_never_removed(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    reading, other = write(cache, "value", "reading", 0.1), write(cache, "value", "other", 1.0)
    sweep = sweeper(cache, redis_client, stack_settings, [reading, other], 0.95)
    started = time.monotonic()
    assert cache.store.begin_get(str(reading))  # a read in progress holds the entry's lease
    try:
        report = sweep.sweep()
    finally:
        cache.store.end_get(str(reading))
    lease_s = stack_settings.store.lease_ttl_ms / 1000
    assert time.monotonic() - started < lease_s, "the sweep outlasted the read's lease"
    # The least valuable entry is kept while it is read; the next one goes instead.
    assert present(cache, [reading, other]) == [True, False]
    assert (report.evicted, report.busy) == (1, 1)
    assert records(redis_client, "value", [reading])[0] is not None


def test_a_tenant_beyond_its_share_evicts_its_own_entries_first(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    # ``burst`` holds six entries of high value, ``quiet`` two worth little; together 0.9 of
    # the capacity, ``burst`` 0.675 of it, beyond its half share.
    burst = [write(cache, "burst", f"b{i}", 10.0) for i in range(6)]
    quiet = [write(cache, "quiet", f"q{i}", 0.01) for i in range(2)]
    cache.counters.flush()
    size = records(redis_client, "burst", burst[:1])[0].size  # type: ignore[union-attr]
    sweep = ValueSweeper(redis_client, cache.store, cache.counters, int(8 * size / 0.9),
                         stack_settings.cache.model_copy(update={"max_share": 0.5}))
    report = sweep.sweep()
    assert all(present(cache, quiet))  # worth less per byte, yet kept: within its share
    assert sum(present(cache, burst)) == 4
    assert report.evicted == 2


def test_an_entry_the_store_dropped_is_forgotten_and_counted(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    keys = [write(cache, "value", f"e{i}", 0.1 * (i + 1)) for i in range(3)]
    sweep = sweeper(cache, redis_client, stack_settings, keys, 0.9)
    assert cache.store.remove(str(keys[0]))  # as Mooncake's LRU would, behind the index
    report = sweep.sweep()
    assert (report.evicted, report.found_gone) == (0, 1)
    assert present(cache, keys) == [False, True, True]
    assert records(redis_client, "value", keys[:1]) == [None]
    cache.counters.flush()
    assert read_totals(redis_client, "value")["output.found_gone"] == 1


def test_an_expired_entry_is_forgotten_by_the_ttl_sweep(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    key = StoreKey("value", KeyKind.CFG, "soon")
    cache.put(key, torch.zeros(FLOATS), cost_s=0.1)
    cache.counters.flush()
    assert held(redis_client, "value")[KeyKind.CFG] > 0
    redis_client.zadd(ttl_index("value"), {str(key): 1})  # its expiry, long past
    cache.ttl_index.sweep(cache.store)
    assert not cache.exists(key) and held(redis_client, "value") == {}


def test_the_eviction_band_is_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"cache\.evict_to"):
        CacheSettings(evict_above=0.7, evict_to=0.8)


def test_an_entry_removed_before_its_record_is_written_leaves_none(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    key = write(cache, "value", "brief", 0.1)  # its record still queued
    assert cache.remove(key)
    cache.counters.flush()
    assert records(redis_client, "value", [key]) == [None]
    assert held(redis_client, "value") == {}


def test_a_second_write_of_a_key_keeps_its_first_record(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    key = write(cache, "value", "twice", 0.5)
    write(cache, "value", "twice", 2.0)  # content-keyed: the first write stands
    cache.counters.flush()
    record = records(redis_client, "value", [key])[0]
    assert record is not None and record.cost_s == 0.5
    assert held(redis_client, "value") == {KeyKind.OUTPUT: record.size}


def priority(client: redis.Redis, key: StoreKey) -> float:
    score = client.zscore(value_keys(key.tenant)[1], str(key))
    assert score is not None, f"{key} has no priority"
    return float(score)


def test_a_kind_never_read_back_weighs_its_cost_by_little(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    # Ten checkpoints never read, ten outputs read once each: a new checkpoint that cost twice
    # what a new output of its size did still ranks below it.
    for i in range(10):
        cache.put(StoreKey("never", KeyKind.CHECKPOINT, f"old{i}"), torch.zeros(FLOATS),
                  cost_s=0.1)
        assert cache.get(write(cache, "never", f"old{i}", 0.1)) is not None
    cache.counters.flush()
    checkpoint = StoreKey("never", KeyKind.CHECKPOINT, "new")
    cache.put(checkpoint, torch.zeros(FLOATS), cost_s=0.2)
    output = write(cache, "never", "new", 0.1)
    cache.counters.flush()
    assert priority(redis_client, checkpoint) < priority(redis_client, output)
    # Once read, the checkpoint is judged by its own reads: now it ranks above.
    assert cache.get(checkpoint) is not None
    cache.counters.flush()
    assert priority(redis_client, checkpoint) > priority(redis_client, output)


def new_entry_priorities(cache: TensorCache, client: redis.Redis, tenant: str,
                         embedding_reads: list[int]) -> tuple[float, float]:
    """With one embedding written per count in ``embedding_reads`` and read that many times,
    and as many outputs read once each: a new embedding's and a new output's priorities (same
    size and cost), less the clock every priority starts from."""
    for i, reads in enumerate(embedding_reads):
        embedding = StoreKey(tenant, KeyKind.EMBEDDING, f"old{i}")
        cache.put(embedding, torch.zeros(FLOATS), cost_s=0.1)
        for _ in range(reads):
            assert cache.get(embedding) is not None
        assert cache.get(write(cache, tenant, f"old{i}", 0.1)) is not None
    cache.counters.flush()
    embedding = StoreKey(tenant, KeyKind.EMBEDDING, "new")
    cache.put(embedding, torch.zeros(FLOATS), cost_s=0.1)
    output = write(cache, tenant, "new", 0.1)
    cache.counters.flush()
    clock = read_clock(client)  # after earlier sweeps, not 0
    return priority(client, embedding) - clock, priority(client, output) - clock


def test_a_new_entry_expects_the_reads_of_its_class(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    # Every embedding so far was read five times, every output once: a new embedding ranks
    # above a new output of the same size and cost, though every one of both was read back.
    embedding, output = new_entry_priorities(cache, redis_client, "many", [5] * 5)
    assert embedding > 2 * output


def test_one_entry_read_by_everyone_does_not_price_its_whole_class(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    # One embedding read by every request (a shared negative prompt), four never read; every
    # output read once. A new embedding expects at most the reads counted per entry.
    embedding, output = new_entry_priorities(cache, redis_client, "skew", [40, 0, 0, 0, 0])
    assert embedding < 2 * output


def test_a_checkpoint_is_priced_by_the_reads_at_its_step(
        cache: TensorCache, redis_client: redis.Redis) -> None:
    # Resumes and edits start from step 4 here, never from step 2.
    def checkpoint(step: int, name: str) -> StoreKey:
        key = StoreKey("steps", KeyKind.CHECKPOINT, f"{step}-{name}")
        cache.put(key, torch.zeros(FLOATS), cost_s=0.1)
        return key

    for i in range(10):
        checkpoint(2, f"old{i}")
        assert cache.get(checkpoint(4, f"old{i}")) is not None
    cache.counters.flush()
    at_2, at_4 = checkpoint(2, "new"), checkpoint(4, "new")
    cache.counters.flush()
    assert priority(redis_client, at_2) < priority(redis_client, at_4)


def test_an_input_a_request_in_flight_holds_is_kept_until_released(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    needed, other = write(cache, "value", "needed", 0.1), write(cache, "value", "other", 1.0)
    cache.hold_inputs("value", "r1", [needed])
    sweep = sweeper(cache, redis_client, stack_settings, [needed, other], 0.95)
    report = sweep.sweep()
    # The least valuable entry is kept while a request needs it; the next one goes instead.
    assert (report.evicted, report.needed) == (1, 1)
    assert records(redis_client, "value", [needed, other])[1] is None
    cache.release_inputs("value", "r1", [needed])
    sweep.capacity = 1  # whatever is left is too much
    assert (sweep.sweep().evicted, present(cache, [needed, other])) == (1, [False, False])


def test_the_inputs_of_a_request_that_ended_are_let_go(
        cache: TensorCache, redis_client: redis.Redis, stack_settings: Settings) -> None:
    running = write(cache, "value", "of-running", 0.05)
    cancelled = write(cache, "value", "of-cancelled", 0.1)
    other = write(cache, "value", "unheld", 1.0)
    for request_id, key in (("running", running), ("cancelled", cancelled)):
        spec = GenerationSpec.create(
            request_id=request_id, tenant="value", prompt="p", width=16, height=16,
            num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=0,
            output_format=OutputFormat.NPY)
        redis_client.hset(request_record("value", request_id), mapping={
            k: str(v) for k, v in initial_fields(spec).set.items()})
        cache.hold_inputs("value", request_id, [key])
    # Cancelled while queued: no decode will ever release what it holds.
    Scripts(redis_client).run(CancelArgs(request_record("value", "cancelled"), timestamp()))
    keys = [running, cancelled, other]
    report = sweeper(cache, redis_client, stack_settings, keys, 0.95,
                     Records(redis_client).ended).sweep()
    assert (report.evicted, report.needed) == (1, 1)
    assert present(cache, keys) == [True, False, True]
    assert {r: set(keys) for r, keys in held_inputs(redis_client, "value", time.time()).items()
            } == {"running": {str(running)}}


def test_a_hold_taken_again_since_it_was_read_stays(redis_client: redis.Redis) -> None:
    key, now = StoreKey("value", KeyKind.OUTPUT, "again"), time.time()
    hold(redis_client, "value", "resumed", [key], until=now + 60)
    seen = held_inputs(redis_client, "value", now)
    # Ended, then resumed before the sweeper acted: its encode holds the input anew.
    hold(redis_client, "value", "resumed", [key], until=now + 120)
    assert drop_holds(redis_client, "value", {"resumed": seen["resumed"]}) == 0
    again = held_inputs(redis_client, "value", now)
    assert again == {"resumed": {str(key): now + 120}}
    assert drop_holds(redis_client, "value", again) == 1
    assert held_inputs(redis_client, "value", now) == {}


def test_a_hold_never_released_lapses(cache: TensorCache, redis_client: redis.Redis) -> None:
    key = write(cache, "value", "lapsed", 0.1)
    hold(redis_client, "value", "r1", [key], until=time.time() - 1)  # its worker died
    hold(redis_client, "value", "r2", [StoreKey("value", KeyKind.LATENTS, "l")],
         until=time.time() + 60)  # in flight between stages: never recorded, never held
    assert held_inputs(redis_client, "value", time.time()) == {}
