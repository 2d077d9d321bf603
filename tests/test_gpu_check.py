"""The device check runs here first, on the CPU at small sizes, as a lent GPU would run it: so
a machine lent for minutes spends them measuring, not finding a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_the_device_check_runs_and_every_family_is_its_pipeline(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "run", "--device", "cpu", "--smoke",
         "--warm-up-s", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
             "GPU_CHECK_DIR": str(tmp_path / "none")})
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == figures
    assert set(figures["families"]) == {"wan", "wan-i2v", "qwen-image", "qwen-image-edit"}
    for name, family in figures["families"].items():
        # bfloat16 on the CPU: the workers' components are their pipeline's, bit for bit.
        assert family["identical"] and family["max_abs_diff"] == 0, name
        assert family["proven_batch_sizes"] and family["forwards"]["batched"] < \
            family["forwards"]["alone"], name
