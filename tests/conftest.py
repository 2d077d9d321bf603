"""Session fixtures: two real embedded stacks (Mooncake master, storage node, Valkey) per run,
started through the same code as ``diffcache up``. The worker pool runs on one; nothing in it is
ever flushed. The other has no worker process: the cache tests and the tests that drive streams
by hand use it, each on a Redis database of its own (``tests/redis_databases.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings, load_settings
from supervision.processes import ChildProcess
from supervision.stack import EmbeddedStack
from tests import redis_databases
from tests.workers_harness import publish_as_workers, serving, worker_pool
from workers.families import qwen_image, qwen_image_edit, wan, wan_i2v
from workers.families.base import CPU
from workers.queue.messages import Stage

# The tiny random Wan model (the video family) unless a test names another: what requests
# to a stack without workers are checked against.
TEST_MODEL = {"preset": "test"}


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """The stack the session's worker pool runs on, with a small (128 MiB) storage node."""
    data_dir: Path = tmp_path_factory.mktemp("stack")
    stack = EmbeddedStack(load_settings(data_dir=str(data_dir), store={"segment_mib": 128},
                                        model=TEST_MODEL))
    with stack:
        yield stack


@pytest.fixture(scope="session")
def workerless_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A second stack (128 MiB storage node) that no session worker reads: for the cache tests
    and the tests that drive streams and workers by hand. Its Redis URL names db 0; each test
    module moves to a database of its own with ``redis_databases.on_database``."""
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("workerless")),
                             store={"segment_mib": 128}, model=TEST_MODEL)
    stack = EmbeddedStack(settings)
    with stack as addresses:
        yield stack.resolved(addresses)


@pytest.fixture(scope="session")
def stack_settings(workerless_stack: Settings) -> Settings:
    """Settings of the cache tests: the worker-free stack's store, and its Redis database
    ``redis_databases.CACHE``, which only these tests use."""
    return redis_databases.on_database(workerless_stack, redis_databases.CACHE)


@pytest.fixture(scope="session")
def _session_cache(stack_settings: Settings) -> Iterator[TensorCache]:
    cache = open_cache(stack_settings)
    yield cache
    cache.close()


@pytest.fixture
def redis_client(stack_settings: Settings, _session_cache: TensorCache) -> redis.Redis:
    """The cache tests' Redis database, emptied (no worker uses it)."""
    _session_cache.counters.flush()
    return redis_databases.emptied(stack_settings)


@pytest.fixture
def cache(_session_cache: TensorCache, redis_client: redis.Redis) -> TensorCache:
    """The session's cache over an empty store and an empty Redis database: the worker-free
    stack's, so emptying them takes nothing from a worker."""
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
def edit_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-edit-model")
    qwen_image_edit.build(directory, "test")
    return directory


@pytest.fixture(scope="session")
def i2v_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wan-i2v-model")
    wan_i2v.build(directory, "test")
    return directory


@pytest.fixture(scope="session")
def worker_settings(embedded_stack: EmbeddedStack, model_dir: Path) -> Settings:
    """Settings of the worker pool and the tests that use it: the embedded stack, the test
    model, quick lease takeover."""
    assert embedded_stack.addresses is not None
    return serving(embedded_stack.resolved(embedded_stack.addresses), model_dir)


@pytest.fixture(scope="session")
def client(worker_settings: Settings) -> redis.Redis:
    return open_redis(worker_settings)


@pytest.fixture(scope="session")
def served(worker_settings: Settings, client: redis.Redis) -> None:
    """The test model published as served, as the pool's workers would: for API tests that
    need no worker to run a request."""
    publish_as_workers(client, worker_settings)


@pytest.fixture(scope="session")
def pool(worker_settings: Settings, client: redis.Redis,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Stage, list[ChildProcess]]]:
    """One worker per stage for the whole module; tests may add and kill more."""
    with worker_pool(worker_settings, client, tmp_path_factory.mktemp("worker-logs"),
                     "0") as workers:
        yield workers


@pytest.fixture(scope="session")
def pipe(model_dir: Path) -> object:
    """The monolithic ``WanPipeline`` on the test model, as ``reference`` calls it."""
    return wan.FAMILY.reference(model_dir, CPU)


