"""Starting worker processes: the command line, and waiting until one has joined its group."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping

from cachesvc.connect import RedisClient
from cachesvc.processes import ChildProcess
from cachesvc.settings import ModelSettings
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


def device_environ(model: ModelSettings, stages: Mapping[Stage, int], gpus: int
                   ) -> Iterator[tuple[Stage, int, dict[str, str]]]:
    """Each worker ``stages`` counts, with the variables that put it on a device of its own
    where the settings say ``cuda`` (or ``auto``) and this machine has ``gpus`` > 1: the
    workers that compute on CUDA take ``cuda:0``, ``cuda:1``, ... in turn, so each process
    opens one device instead of all opening device 0. A ``cuda:N`` setting is left as it is,
    and so are CPU workers."""
    turn = 0
    for stage, count in stages.items():
        for i in range(count):
            encoders = stage is Stage.ENCODE and model.encode_device != "same"
            field, value = (("ENCODE_DEVICE", model.encode_device) if encoders
                            else ("DEVICE", model.device))
            if gpus > 1 and (value == "cuda" or (value == "auto" and not encoders)):
                yield stage, i, {f"DIFFCACHE_MODEL__{field}": f"cuda:{turn % gpus}"}
                turn += 1
            else:
                yield stage, i, {}
