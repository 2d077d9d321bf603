"""Starting worker processes: the command line, and waiting until one has joined its group."""

from __future__ import annotations

import sys

import redis

from cachesvc.processes import ChildProcess
from workers.messages import Stage
from workers.runtime import consumer_name
from workers.streams import live_consumers

STARTUP_TIMEOUT_S = 180.0  # imports and model loading, on a busy 2-core machine


def worker_argv(stage: Stage) -> list[str]:
    return [sys.executable, "-m", "workers", stage.value]


def wait_joined(child: ChildProcess, client: redis.Redis, stage: Stage) -> None:
    """Block until ``child`` polls its stage's stream; StartupError if it dies first."""
    name = consumer_name(child.pid)

    def joined() -> bool:
        return name in live_consumers(client, stage)

    child.wait_healthy(joined, STARTUP_TIMEOUT_S, f"See {child.log_path}")
