"""Session fixtures: one real embedded stack (Mooncake master, storage node, Valkey) per run,
started through the same code as ``diffcache up``, and a flush of both stores before each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachesvc.connect import open_cache, open_redis
from cachesvc.settings import Settings, load_settings
from cachesvc.stack import EmbeddedStack
from cachesvc.tensor_cache import TensorCache


@pytest.fixture(scope="session")
def stack_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings that reach a running embedded stack with a small (128 MiB) storage node."""
    data_dir: Path = tmp_path_factory.mktemp("stack")
    settings = load_settings(data_dir=str(data_dir), store={"segment_mib": 128})
    stack = EmbeddedStack(settings)
    with stack as addresses:
        yield stack.resolved(addresses)


@pytest.fixture(scope="session")
def _session_cache(stack_settings: Settings) -> Iterator[TensorCache]:
    cache = open_cache(stack_settings)
    yield cache
    cache.close()


@pytest.fixture
def redis_client(stack_settings: Settings, _session_cache: TensorCache) -> redis.Redis:
    client = open_redis(stack_settings)
    _session_cache.counters.flush()
    client.flushall()
    return client


@pytest.fixture
def cache(_session_cache: TensorCache, redis_client: redis.Redis) -> TensorCache:
    """The session's cache over an empty store and an empty Redis."""
    _session_cache.store.remove_all()
    return _session_cache
