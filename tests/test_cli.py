"""The ``diffcache`` client commands against a served API and real workers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import redis
from typer.testing import CliRunner

from cachesvc.waiting import wait_until
from cli.main import app
from config.settings import ApiSettings, Settings
from keys import CfgCache, CfgMode, StepCachePolicy
from tests.workers_harness import serve_api
from workers.queue.records import Records
from workers.stages.media import decode_npy

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


def test_generate_status_preempt_and_resume(worker_settings: Settings, pool: object,
                                            client: redis.Redis, tmp_path: Path) -> None:
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
        # Every field the API takes: a schedule in place of the prompt, the CFG and step
        # caches with their parameters, as the record keeps them.
        scheduled = run("generate", "--schedule", "2:a red kite", "--schedule", "4:a blue kite",
                        "--cfg-cache", "interval:2", "--step-cache", "first_block:threshold=0.2",
                        "--out", str(tmp_path / "scheduled.npy"), "--steps", "4",
                        "--num-frames", "5")
        request_id = re.search(r"for request (\S+);", scheduled)
        assert request_id, scheduled
        record = Records(client).get(worker_settings.default_tenant, request_id[1])
        assert record is not None
        assert [(s.until_step, s.prompt) for s in record.spec.schedule] == [
            (2, "a red kite"), (4, "a blue kite")]
        assert record.spec.cfg_cache == CfgCache(CfgMode.INTERVAL, 2)
        assert record.spec.step_cache.policy is StepCachePolicy.FIRST_BLOCK
        assert dict(record.spec.step_cache.params)["threshold"] == 0.2
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
