"""Write admission against the real store and Redis: a kind whose lookups find nothing stops
being written, but for a key written twice or sampled, and is written whole again once its
keys are read back; other kinds are always written."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import torch

from cachesvc.counters import read_totals
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from cachesvc.write_admission import VERDICT_S, WriteAdmission
from config.settings import CacheSettings, Settings
from keys import KeyKind, StoreKey

TENANT = "admission"


class Clock:
    """Wall time, moved on by hand past a verdict's life (counters stay in real minutes)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def next_verdict(self) -> None:
        self.offset += VERDICT_S


@pytest.fixture
def judged(stack_settings: Settings, cache: TensorCache, redis_client: redis.Redis
           ) -> Iterator[tuple[TensorCache, Clock, CacheSettings]]:
    """A cache that judges CFG writes after 20 lookups hitting less than a fifth of the time,
    sampling one key in a thousand, on the clock it returns."""
    settings = stack_settings.cache.model_copy(update={
        "admission_min_lookups": 20, "admission_min_hit_rate": 0.2, "admission_sample": 1000})
    judging = TensorCache(MooncakeStore.connect(StoreEndpoints.configured(stack_settings.store),
                                                stack_settings.store),
                          redis_client, settings, stack_settings.store)
    clock = Clock()
    judging.admission = WriteAdmission(redis_client, settings, judging.counters, clock)
    try:
        yield judging, clock, settings
    finally:
        judging.close()


def cfg_key(sampled: bool = False, sample: int = 1000) -> StoreKey:
    """A new CFG key, one that the admission samples or one it does not (one in ``sample``
    is: among ten times as many fresh names, one is all but sure)."""
    keys = (StoreKey(TENANT, KeyKind.CFG, uuid.uuid4().hex) for _ in range(10 * sample))
    return next(key for key in keys if WriteAdmission.sampled(key, sample) == sampled)


def counted(cache: TensorCache, clock: Clock, client: redis.Redis, lookups: int) -> None:
    """Once the tenant's counters in Redis show ``lookups`` CFG lookups, a verdict later."""
    cache.counters.flush()
    wait_until(lambda: read_totals(client, TENANT).get("cfg.lookups", 0) >= lookups,
               timeout_s=30, interval_s=0.05, what=f"{lookups} CFG lookups counted")
    clock.next_verdict()


def test_a_kind_never_read_back_stops_being_written_and_resumes_once_reused(
        judged: tuple[TensorCache, Clock, CacheSettings], redis_client: redis.Redis) -> None:
    cache, clock, _ = judged
    first = cfg_key()
    cache.put(first, torch.ones(4))
    assert cache.exists(first)  # no lookups yet to judge by
    # Random seeds: every CFG feature's key is new, and its lookup misses.
    for _ in range(20):
        assert cache.get(cfg_key()) is None
    counted(cache, clock, redis_client, 20)
    once = cfg_key()
    assert cache.get(once) is None
    cache.put(once, torch.ones(4))
    assert not cache.exists(once)  # 21 lookups, no hit: refused
    output = StoreKey(TENANT, KeyKind.OUTPUT, uuid.uuid4().hex)
    cache.put(output, torch.ones(4))
    assert cache.exists(output)  # outputs are always written
    cache.put(once, torch.ones(4))
    assert cache.exists(once)  # its second write is taken: a key that recurs is kept
    sampled = cfg_key(sampled=True)
    cache.put(sampled, torch.ones(4))
    assert cache.exists(sampled)  # and one new key in a thousand, so reuse can show
    # The keys recur (seeded repeats): the lookups hit, and the kind is written whole again.
    for _ in range(10):
        assert cache.get(once) is not None
    counted(cache, clock, redis_client, 31)
    verdict = cache.admission.verdict(TENANT, KeyKind.CFG)
    assert (verdict.lookups, verdict.hits, verdict.cold) == (31, 10, False)
    fresh = cfg_key()
    cache.put(fresh, torch.ones(4))
    assert cache.exists(fresh)
    cache.counters.flush()
    wait_until(lambda: read_totals(redis_client, TENANT).get("cfg.writes_refused") == 1,
               timeout_s=30, interval_s=0.05, what="the one refused write counted")


def test_a_batch_write_takes_what_is_admitted_and_every_worker_decides_alike(
        judged: tuple[TensorCache, Clock, CacheSettings], redis_client: redis.Redis) -> None:
    cache, clock, settings = judged
    for _ in range(20):
        assert cache.get(cfg_key()) is None
    counted(cache, clock, redis_client, 20)
    new, sampled = cfg_key(), cfg_key(sampled=True)
    embedding = StoreKey(TENANT, KeyKind.EMBEDDING, uuid.uuid4().hex)
    cache.batch_put([(new, torch.ones(2)), (sampled, torch.ones(2)), (embedding, torch.ones(2))],
                    cost_s=[0.1, 0.2, 0.3])
    assert [cache.exists(k) for k in (new, sampled, embedding)] == [False, True, True]
    # Another worker's admission reads the same counters and the refused key's mark.
    other = WriteAdmission(redis_client, settings, cache.counters, clock)
    assert other.verdict(TENANT, KeyKind.CFG).cold
    assert other.admit([new, cfg_key()]) == [True, False]
