"""An unreachable store is a typed, retryable error, never a silent miss; callers that can
recompute do so and count it. Uses a stack of its own, since it kills that stack's master."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from cachesvc.connect import open_cache
from cachesvc.errors import StoreUnavailableError
from cachesvc.mooncake_store import MooncakeStore, StoreEndpoints, mounted_bytes
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from config.settings import Settings, load_settings
from keys import KeyKind, StoreKey
from supervision.processes import port_open
from supervision.stack import EmbeddedStack
from tests.conftest import TEST_MODEL
from tests.counting import counted

# Each test starts a stack of its own and kills part of it: seconds each.
pytestmark = pytest.mark.slow


@pytest.fixture
def doomed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedStack, Settings]]:
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("doomed")),
                             store={"segment_mib": 32}, model=TEST_MODEL)
    stack = EmbeddedStack(settings)
    with stack as addresses:
        yield stack, stack.resolved(addresses)


def test_store_down_raises_typed_error_and_degrades(
        doomed: tuple[EmbeddedStack, Settings]) -> None:
    stack, settings = doomed
    cache: TensorCache = open_cache(settings)
    key = StoreKey("acme", KeyKind.EMBEDDING, "e")
    cache.put(key, torch.ones(4))
    master = next(c for c in stack.children if c.name == "mooncake_master")
    master.kill()
    host, _, port = StoreEndpoints.configured(settings.store).master_address.rpartition(":")
    wait_until(lambda: not port_open(host, int(port), timeout_s=0.2), timeout_s=10,
               what="the killed master's port closed")
    with pytest.raises(StoreUnavailableError) as info:
        cache.get(key)
    assert info.value.retryable and info.value.key == str(key)
    # A caller that can recompute does, and the outage is counted rather than hidden.
    cached = cache.get_or_compute(key, lambda: torch.zeros(4))
    assert cached.outcome is None and torch.equal(cached.tensor, torch.zeros(4))
    unavailable = counted(cache, open_redis(settings), "acme").get("embed.store_unavailable", 0)
    assert unavailable >= 2
    cache.close()


def test_connecting_to_no_store_fails_fast(doomed: tuple[EmbeddedStack, Settings]) -> None:
    _, settings = doomed
    dead = settings.store.model_copy(update={"connect_timeout_s": 0.5})
    endpoints = StoreEndpoints.configured(settings.store)
    stack, _ = doomed
    stack.stop()
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="nothing answers"):
        MooncakeStore.connect(endpoints, dead)
    assert time.monotonic() - start < 10


def test_a_store_without_storage_nodes_is_unavailable_not_full(
        doomed: tuple[EmbeddedStack, Settings]) -> None:
    stack, settings = doomed
    cache: TensorCache = open_cache(settings)
    stack.child("mooncake_client").kill()
    url = settings.store.master_metrics_url
    assert url is not None
    # The master forgets the node once its lease runs out.
    wait_until(lambda: mounted_bytes(url) == 0, timeout_s=60, interval_s=0.5,
               what="the master reporting no mounted storage")
    with pytest.raises(StoreUnavailableError, match="no storage node is mounted"):
        cache.put(StoreKey("acme", KeyKind.SCRATCH, "after"), torch.ones(4))
    cache.close()
