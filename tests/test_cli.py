"""The ``diffcache`` client commands against a served API and real workers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cachesvc.waiting import wait_until
from cli.main import app
from config.settings import ApiSettings, Settings
from tests.workers_harness import serve_api
from workers.stages.media import decode_npy

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


def test_generate_status_preempt_and_resume(worker_settings: Settings, pool: object,
                                            tmp_path: Path) -> None:
    runner = CliRunner()
    with serve_api(worker_settings, ApiSettings()) as url:
        env = {"DIFFCACHE_API__PORT": url.rsplit(":", 1)[1], "DIFFCACHE_DATA_DIR": str(tmp_path)}

        def run(*args: str) -> str:
            result = runner.invoke(app, list(args), env=env)
            assert result.exit_code == 0, result.output
            return result.output

        first = tmp_path / "first.npy"
        printed = run("generate", "a red kite over a hill", "--out", str(first),
                      "--output-format", "npy", "--steps", "4", "--num-frames", "5",
                      "--priority", "batch")
        assert "cache hits" in printed
        assert decode_npy(first.read_bytes()).shape[0] == 5
        board = run("status")
        assert "denoise" in board and "batch" in board and "interactive" in board

        refused = runner.invoke(app, ["preempt", "no-such-request"], env=env)
        assert refused.exit_code == 1 and "no request" in refused.output

        body = {"prompt": "a slow river", "output_format": "npy", "num_frames": 5,
                "num_inference_steps": 60}
        request_id = httpx.post(f"{url}/v1/generate", json=body).json()["id"]
        wait_until(lambda: httpx.get(f"{url}/v1/requests/{request_id}").json()["step"] >= 2,
                   timeout_s=120, what="denoised two steps")
        assert httpx.delete(f"{url}/v1/requests/{request_id}").status_code == 202
        resumed = tmp_path / "resumed.npy"
        run("resume", request_id, "--out", str(resumed))
        assert decode_npy(resumed.read_bytes()).shape[0] == 5


def test_foreseeable_client_errors_are_one_line(tmp_path: Path) -> None:
    import subprocess

    from bench.service_process import DIFFCACHE, diffcache_environ
    from supervision.processes import free_port

    environ = diffcache_environ(DIFFCACHE_API__PORT=str(free_port("127.0.0.1")),
                                DIFFCACHE_DATA_DIR=str(tmp_path))

    def generate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*DIFFCACHE, "generate", "a red fox", *args], env=environ,
                              capture_output=True, text=True, timeout=120, check=False)

    nobody = generate("--out", str(tmp_path / "fox.png"))
    assert nobody.returncode == 1
    assert "no API at" in nobody.stderr and "Traceback" not in nobody.stderr
    mismatch = generate("--out", str(tmp_path / "fox.png"), "--output-format", "mp4")
    assert mismatch.returncode == 1
    assert "does not match" in mismatch.stderr and "Traceback" not in mismatch.stderr
