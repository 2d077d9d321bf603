"""The dashboard in a real headless Chromium: after a short workload, its hit-rate chart has
points above zero. Needs Debian's chromium, which `make test` installs."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from cachesvc.counters import read_totals
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from tests.workers_harness import serve_api

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=8000", "--window-size=1200,900"]


@pytest.fixture(scope="module")
def server(worker_settings: Settings, pool: object) -> Iterator[str]:
    with serve_api(worker_settings, ApiSettings()) as url:
        yield url


def run_workload(url: str, client: redis.Redis) -> None:
    before = read_totals(client, "default")
    ids = []
    for seed in range(3):  # one prompt three times: its embeddings hit after the first
        body = {"prompt": "a small boat in the rain", "seed": seed, "output_format": "npy",
                "width": 32, "height": 32, "num_frames": 1, "num_inference_steps": 2}
        ids.append(httpx.post(f"{url}/v1/generate", json=body).json()["id"])
    for request_id in ids:
        wait_until(lambda rid=request_id: httpx.get(
            f"{url}/v1/requests/{rid}").json()["state"] == "DONE", timeout_s=120,
                   interval_s=0.05, what=f"request {request_id} done")

    def counted(name: str) -> float:
        return read_totals(client, "default").get(name, 0) - before.get(name, 0)

    # The workers flush their counters on a timer: wait until this workload's are in Redis
    # (the embeddings of the second and third requests hit; each guided step looked up the
    # CFG cache), rather than for a time that is usually long enough.
    wait_until(lambda: counted("embed.hits") >= 2 and counted("cfg.lookups") >= 6,
               timeout_s=30, interval_s=0.05, what="the workload's counters flushed")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_dashboard_shows_hit_rates(server: str, client: redis.Redis, tmp_path: Path) -> None:
    run_workload(server, client)
    assert CHROMIUM is not None
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *FLAGS, *profile, "--dump-dom", f"{server}/dashboard"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    points = [float(v) for v in re.findall(
        r'<circle[^>]*data-kind="embed"[^>]*data-value="([0-9.eE+-]+)"', dom)]
    assert points and max(points) > 0, "no embed hit-rate point above zero"
    assert "DONE" in dom  # the recent-requests table
    # The reuse table: every guided step of the workload looked up the CFG cache.
    cfg = re.search(r"<tr><td>default</td><td>cfg</td><td>(\d+)</td><td>(\d+)</td>", dom)
    assert cfg is not None and int(cfg.group(1)) >= 6, "no CFG lookups in the reuse table"
    shot = tmp_path / "dashboard.png"
    subprocess.run([CHROMIUM, *FLAGS, *profile, f"--screenshot={shot}", f"{server}/dashboard"],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000
