"""The API listens at once: it serves health, status and admission while its store client is
still connecting (here: to a store that never answers), says on ``/readyz`` what is not ready,
and after a kill -9 the restarted process answers again without waiting for the store."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings, StoreSettings, child_environ
from supervision.processes import ChildProcess, free_port
from tests.redis_databases import API_START, emptied, on_database

# Starts an API process: left out of the fast subset.
pytestmark = pytest.mark.slow


@pytest.fixture
def settings(workerless_stack: Settings, tmp_path: Path) -> Settings:
    """The worker-free stack's Redis (a database of its own), and a store whose master and
    metadata server are ports nothing listens on."""
    base = on_database(workerless_stack, API_START)
    emptied(base)
    nowhere = free_port("127.0.0.1")
    return base.model_copy(update={
        "data_dir": tmp_path,
        "store": StoreSettings(master_address=f"127.0.0.1:{nowhere}",
                               metadata_server=f"http://127.0.0.1:{nowhere}/metadata"),
        "api": ApiSettings(port=free_port("127.0.0.1"))})


@pytest.fixture
def api(settings: Settings, tmp_path: Path) -> Iterator[ChildProcess]:
    child = ChildProcess("api", [sys.executable, "-m", "api"], tmp_path / "api.log",
                         child_environ(settings))
    yield child
    child.stop()


def answering(url: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=1)
    except httpx.TransportError:
        return None


def test_the_api_serves_while_its_store_never_answers_and_after_a_kill(
        settings: Settings, api: ChildProcess) -> None:
    url = f"http://127.0.0.1:{settings.api.port}"
    for start in ("first start", "restart after kill -9"):
        api.start()
        began = time.monotonic()
        health = wait_until(lambda: answering(url), timeout_s=60, interval_s=0.05,
                            what=f"/healthz answering after the API's {start}")
        print(f"{start}: /healthz answered {time.monotonic() - began:.2f} s after spawn")
        assert health.status_code == 200
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["checks"]["store"] is False
        assert ready.json()["checks"]["redis"] is True
        assert "not connected yet" in ready.json()["not_ready"]["store"]
        missing = httpx.get(f"{url}/v1/requests/0123456789abcdef0123456789abcdef", timeout=10)
        assert missing.status_code == 404  # status needs Redis only
        api.kill()
