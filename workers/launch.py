"""Starting worker processes: the command line, and waiting until one has joined its group."""

from __future__ import annotations

import sys

from cachesvc.connect import RedisClient
from cachesvc.processes import ChildProcess
from workers.queue.heartbeats import live_workers
from workers.queue.messages import Stage
from workers.queue.runtime import consumer_name

STARTUP_TIMEOUT_S = 180.0  # imports and model loading, on a busy 2-core machine
JOINED_WITHIN_S = 5.0


def worker_argv(stage: Stage) -> list[str]:
    return [sys.executable, "-m", "workers", stage.value]


def wait_joined(child: ChildProcess, client: RedisClient, stage: Stage) -> None:
    """Block until ``child`` beats as a worker of its stage; StartupError if it dies first."""
    name = consumer_name(child.pid)

    def joined() -> bool:
        return name in live_workers(client, stage, within_s=JOINED_WITHIN_S)

    child.wait_healthy(joined, STARTUP_TIMEOUT_S, f"See {child.log_path}")
