"""``diffcache up`` as a user runs it: starts, prints addresses, stops cleanly, leaves no orphan
even when killed, and reports start failures in one line."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.service_process import (
    DIFFCACHE,
    ServiceProcess,
    children_of,
    diffcache_environ,
    wait_gone,
)
from config.settings import Settings
from supervision.processes import free_port
from tests.redis_databases import EXTERNAL_REDIS, on_database

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

@contextmanager
def diffcache_up(tmp_path: Path, **env: str) -> Iterator[tuple[ServiceProcess, str]]:
    environ = diffcache_environ(**{
        "DIFFCACHE_DATA_DIR": str(tmp_path), "DIFFCACHE_STORE__SEGMENT_MIB": "32",
        "DIFFCACHE_API__PORT": str(free_port("127.0.0.1")),
        **{f"DIFFCACHE_WORKERS__{s}_WORKERS": "0" for s in ("ENCODE", "DENOISE", "DECODE")},
        **env})
    service = ServiceProcess(environ, "up")
    try:
        yield service, service.wait_for_start()
    finally:
        service.kill_tree()


def test_up_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    with diffcache_up(tmp_path) as (service, out):
        assert "is up" in out and "redis://127.0.0.1:" in out and "mooncake master" in out
        kids = children_of(service.pid)
        assert len(kids) == 4  # master, storage node, valkey, api
        assert service.stop(signal.SIGINT) == 0
        wait_gone(kids)
    assert (tmp_path / "valkey" / "appendonlydir").is_dir()  # AOF is on


def test_kill_9_of_the_supervisor_leaves_no_orphan(tmp_path: Path) -> None:
    with diffcache_up(tmp_path) as (service, out):
        assert "is up" in out
        kids = children_of(service.pid)
        service.proc.kill()
        service.proc.wait()
        wait_gone(kids)


def test_a_busy_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with diffcache_up(tmp_path, DIFFCACHE_REDIS__PORT=str(port)) as (service, out):
            assert service.wait(30) == 1
            assert f"port {port} on 127.0.0.1 is in use" in out
            assert "DIFFCACHE_REDIS__PORT=0" in out


def test_an_external_redis_is_used_instead_of_our_own(tmp_path: Path,
                                                      workerless_stack: Settings) -> None:
    # A database of its own: the service's sweeps and statuses touch nobody else's keys.
    url = on_database(workerless_stack, EXTERNAL_REDIS).redis.url
    assert url
    with diffcache_up(tmp_path, DIFFCACHE_REDIS__URL=url) as (service, out):
        assert f"redis           {url}" in out
        assert len(children_of(service.pid)) == 3  # no Valkey of its own
        assert service.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("name, value, expected", [
    ("DIFFCACHE_STORE__SEGMEN_MIB", "64", "unknown setting DIFFCACHE_STORE__SEGMEN_MIB"),
    ("DIFFCACHE_STORE__SEGMENT_MIB", "1", "setting store.segment_mib"),
    ("DIFFCACHE_CACHE__ADMISSION_WINDOW_S", "90", "setting cache.admission_window_s"),
])
def test_bad_settings_are_named(tmp_path: Path, name: str, value: str, expected: str) -> None:
    environ = diffcache_environ(**{name: value})
    done = subprocess.run([*DIFFCACHE, "up"], capture_output=True, text=True, env=environ,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert expected in done.stderr


def test_up_serves_a_prompt_as_a_playable_mp4(tmp_path: Path) -> None:
    """The README's promise: `make up`, then one command turns a prompt into an MP4."""
    import imageio.v3 as iio

    workers = {f"DIFFCACHE_WORKERS__{s}_WORKERS": "1" for s in ("ENCODE", "DENOISE", "DECODE")}
    with diffcache_up(tmp_path, DIFFCACHE_MODEL__PRESET="test", **workers) as (service, out):
        assert "is up" in out and len(children_of(service.pid)) == 7
        environ = diffcache_environ(DIFFCACHE_DATA_DIR=str(tmp_path))
        video = tmp_path / "raccoon.mp4"
        done = subprocess.run([*DIFFCACHE, "submit", "a raccoon in a garden", "--out",
                               str(video)], capture_output=True, text=True, env=environ,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        frames = iio.imread(video)
        assert frames.shape == (9, 96, 96, 3) and frames.std() > 0
        assert service.stop(signal.SIGINT) == 0
