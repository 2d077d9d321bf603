"""Single-flight across processes: concurrent misses on one key compute it once."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import redis
import torch

from cachesvc.connect import open_cache
from cachesvc.single_flight import Outcome, SingleFlight
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import KeyKind, StoreKey

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

KEY = StoreKey("acme", KeyKind.EMBEDDING, "shared-prompt")


def _caller(settings: Settings, callers: int,
            results: mp.Queue[tuple[str | None, list[float]]]) -> None:
    """One process missing on KEY; the compute counts itself in Redis."""
    cache = open_cache(settings)
    client = redis.Redis.from_url(settings.redis.url or "")
    # A barrier: every caller is connected before any looks the key up.
    client.incr("test:ready")
    wait_until(lambda: int(client.get("test:ready") or 0) >= callers, timeout_s=60,
               interval_s=0.005, what="every caller connected")

    def compute() -> torch.Tensor:
        client.incr("test:computes")
        time.sleep(0.5)
        return torch.full((8,), 3.0)

    cached = cache.get_or_compute(KEY, compute)
    results.put((cached.outcome.value if cached.outcome else None,
                 cached.tensor.tolist()))
    cache.close()


def test_concurrent_misses_in_separate_processes_compute_once(
        stack_settings: Settings, cache: TensorCache, redis_client: redis.Redis) -> None:
    ctx = mp.get_context("spawn")
    results: mp.Queue[tuple[str | None, list[float]]] = ctx.Queue()
    callers = 4
    procs = [ctx.Process(target=_caller, args=(stack_settings, callers, results))
             for _ in range(callers)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    assert int(redis_client.get("test:computes") or 0) == 1
    assert sorted(o for o, _ in got) == ["computed"] + ["waited"] * (callers - 1)
    assert all(values == [3.0] * 8 for _, values in got)


def test_waiter_computes_itself_when_its_wait_runs_out(redis_client: redis.Redis) -> None:
    flight = SingleFlight(redis_client, lease_s=30, wait_s=0.2)
    redis_client.set("lock:stuck", "someone-else")  # an owner that never finishes
    result = flight.run("lock:stuck", lambda: None, lambda: 42)
    assert (result.value, result.outcome) == (42, Outcome.COMPUTED_AFTER_TIMEOUT)


def test_a_dead_owners_lease_expires_and_a_waiter_takes_over(redis_client: redis.Redis) -> None:
    flight = SingleFlight(redis_client, lease_s=30, wait_s=10)
    redis_client.set("lock:dead", "crashed-owner", px=200)
    start = time.monotonic()
    result = flight.run("lock:dead", lambda: None, lambda: 7)
    assert result.value == 7 and result.outcome is Outcome.COMPUTED
    assert time.monotonic() - start < 5


def test_a_failed_compute_releases_the_lease(redis_client: redis.Redis) -> None:
    flight = SingleFlight(redis_client, lease_s=30, wait_s=1)

    def boom() -> int:
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError):
        flight.run("lock:boom", lambda: None, boom)
    assert not redis_client.exists("lock:boom")
