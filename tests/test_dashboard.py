"""The dashboard in a real headless Chromium: after a short workload, its hit-rate chart has
points above zero. Needs Debian's chromium, which `make test` installs."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from api.app import create_app
from cachesvc.processes import free_port
from cachesvc.settings import ApiSettings, Settings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=8000", "--window-size=1200,900"]


@pytest.fixture(scope="module")
def server(worker_settings: Settings, pool: object) -> Iterator[str]:
    port = free_port("127.0.0.1")
    app = create_app(worker_settings.model_copy(update={"api": ApiSettings(port=port)}))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    srv.should_exit = True
    thread.join(10)


def run_workload(url: str) -> None:
    ids = []
    for seed in range(3):  # one prompt three times: its embeddings hit after the first
        body = {"prompt": "a small boat in the rain", "seed": seed, "output_format": "npy",
                "width": 32, "height": 32, "num_frames": 1, "num_inference_steps": 2}
        ids.append(httpx.post(f"{url}/v1/generate", json=body).json()["id"])
    for request_id in ids:
        while httpx.get(f"{url}/v1/requests/{request_id}").json()["state"] != "DONE":
            time.sleep(0.05)
    time.sleep(1.5)  # past the workers' counter flush interval


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_dashboard_shows_hit_rates(server: str, tmp_path: Path) -> None:
    run_workload(server)
    assert CHROMIUM is not None
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *FLAGS, *profile, "--dump-dom", f"{server}/dashboard"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    points = [float(v) for v in re.findall(
        r'<circle[^>]*data-kind="embed"[^>]*data-value="([0-9.eE+-]+)"', dom)]
    assert points and max(points) > 0, "no embed hit-rate point above zero"
    assert "DONE" in dom  # the recent-requests table
    shot = tmp_path / "dashboard.png"
    subprocess.run([CHROMIUM, *FLAGS, *profile, f"--screenshot={shot}", f"{server}/dashboard"],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000
