"""Session fixtures: one real embedded stack (Mooncake master, storage node, Valkey) per run,
started through the same code as ``diffcache up``, and a flush of both stores before each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachesvc.connect import open_cache, open_redis
from cachesvc.processes import ChildProcess
from cachesvc.settings import ModelSettings, Settings, WorkerSettings, load_settings
from cachesvc.stack import EmbeddedStack
from cachesvc.tensor_cache import TensorCache
from tests.workers_harness import start_worker
from workers.families import qwen_image, wan
from workers.families.base import CPU
from workers.messages import Stage


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """A running embedded stack with a small (128 MiB) storage node."""
    data_dir: Path = tmp_path_factory.mktemp("stack")
    stack = EmbeddedStack(load_settings(data_dir=str(data_dir), store={"segment_mib": 128}))
    with stack:
        yield stack


@pytest.fixture(scope="session")
def stack_settings(embedded_stack: EmbeddedStack) -> Settings:
    """Settings that reach the session's embedded stack."""
    assert embedded_stack.addresses is not None
    return embedded_stack.resolved(embedded_stack.addresses)


@pytest.fixture(scope="session")
def workerless_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A second, small stack that no session worker reads: for tests that drive streams and
    workers by hand."""
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("workerless")),
                             store={"segment_mib": 16})
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


# --- worker processes over the session stack, with the tiny test model --------------------------

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    wan.build(directory, "test")
    return directory


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-model")
    qwen_image.build(directory, "test")
    return directory


@pytest.fixture(scope="session")
def worker_settings(stack_settings: Settings, model_dir: Path) -> Settings:
    return stack_settings.model_copy(update={
        "model": ModelSettings(dir=model_dir, preset="test"),
        "workers": WorkerSettings(idle_timeout_s=3.0, block_ms=200)})


@pytest.fixture(scope="session")
def client(worker_settings: Settings) -> redis.Redis:
    return open_redis(worker_settings)


@pytest.fixture(scope="session")
def pool(worker_settings: Settings, client: redis.Redis,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Stage, list[ChildProcess]]]:
    """One worker per stage for the whole module; tests may add and kill more."""
    logs = tmp_path_factory.mktemp("worker-logs")
    workers = {stage: [start_worker(worker_settings, stage, logs, client, f"{stage}-0")]
               for stage in Stage}
    yield workers
    for children in workers.values():
        for child in children:
            child.stop()


@pytest.fixture(scope="session")
def pipe(model_dir: Path) -> object:
    """The monolithic ``WanPipeline`` on the test model, as ``reference`` calls it."""
    return wan.FAMILY.reference(model_dir, CPU)


