"""Starting worker processes: the command line, and waiting until one has joined its group."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping

from cachesvc.redis_client import RedisClient
from config.settings import ModelSettings, Settings
from supervision.processes import ChildProcess
from workers.queue.heartbeats import live_workers
from workers.queue.messages import Stage
from workers.queue.runtime import consumer_name

STARTUP_TIMEOUT_S = 180.0  # imports and model loading, on a busy 2-core machine
JOINED_WITHIN_S = 5.0


def with_worker_counts(settings: Settings, gpus: int, cores: int | None = None) -> Settings:
    """``settings`` with ``workers.denoise_workers`` resolved on a machine of ``gpus`` CUDA
    devices and ``cores`` usable CPU cores (this process's, by default): as set, or one per
    GPU where the model computes on a visible GPU (``cuda`` or ``auto``), one on a device
    named outright (``cuda:N``), else one per ``workers.denoise_threads`` cores (a worker
    whose forwards split over ranks, ``workers.denoise_parallel``, counts as that many). A
    CPU worker
    runs one thread per op by default (exactness), so a second worker is what uses a second
    core: on 2 cores, two denoise workers served 1.24x the requests of one (docs: How many
    workers).
    Resolved once, before the workers start, so each reads the same count (their decode
    credits are counted from it)."""
    workers = settings.workers
    if workers.denoise_workers is not None:
        return settings
    device = settings.model.device
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    ranks = workers.denoise_parallel.ranks  # a worker's group: a device or threads each
    if device.startswith("cuda:"):
        count = 1  # the one device named
    elif gpus > 0 and device in ("auto", "cuda"):
        count = max(1, gpus // ranks)
    else:  # as many workers as their threads per op fill the cores (0: every core)
        count = max(1, cores // ((workers.denoise_threads or cores) * ranks))
    return settings.model_copy(update={
        "workers": workers.model_copy(update={"denoise_workers": count})})


def stage_counts(settings: Settings) -> dict[Stage, int]:
    """The workers of each stage that ``settings`` (resolved: ``with_worker_counts``) start."""
    workers = settings.workers
    denoise = 1 if workers.denoise_workers is None else workers.denoise_workers
    return {Stage.ENCODE: workers.encode_workers, Stage.DENOISE: denoise,
            Stage.DECODE: workers.decode_workers}


def worker_argv(stage: Stage) -> list[str]:
    return [sys.executable, "-m", "workers", stage.value]


def wait_joined(child: ChildProcess, client: RedisClient, stage: Stage) -> None:
    """Block until ``child`` beats as a worker of its stage; StartupError if it dies first."""
    name = consumer_name(child.pid)

    def joined() -> bool:
        return name in live_workers(client, stage, within_s=JOINED_WITHIN_S)

    child.wait_healthy(joined, STARTUP_TIMEOUT_S, f"See {child.log_path}")


def device_environ(model: ModelSettings, stages: Mapping[Stage, int], gpus: int,
                   denoise_ranks: int = 1) -> Iterator[tuple[Stage, int, dict[str, str]]]:
    """Each worker ``stages`` counts, with the variables that put it on a device of its own
    where the settings say ``cuda`` (or ``auto``) and this machine has ``gpus`` > 1: the
    workers that compute on CUDA take ``cuda:0``, ``cuda:1``, ... in turn, denoise workers
    first (one per GPU, as ``with_worker_counts`` starts them), so each process opens one
    device instead of all opening device 0; a denoise worker of ``denoise_ranks`` ranks
    takes that many in a row (its rank r computes on its device plus r). A ``cuda:N``
    setting is left as it is, and so are CPU workers."""
    def placed(stage: Stage) -> str:
        """The setting that puts ``stage`` on a device of its own; "" where none does."""
        encoders = stage is Stage.ENCODE and model.encode_device != "same"
        field, value = (("ENCODE_DEVICE", model.encode_device) if encoders
                        else ("DEVICE", model.device))
        on_gpu = gpus > 1 and (value == "cuda" or (value == "auto" and not encoders))
        return field if on_gpu else ""

    turns: dict[tuple[Stage, int], int] = {}
    taken = 0
    for stage in sorted(stages, key=lambda s: s is not Stage.DENOISE):
        if placed(stage):
            for i in range(stages[stage]):
                turns[stage, i] = taken % gpus
                taken += denoise_ranks if stage is Stage.DENOISE else 1
    for stage, count in stages.items():
        field = placed(stage)
        for i in range(count):
            yield stage, i, ({f"DIFFCACHE_MODEL__{field}": f"cuda:{turns[stage, i]}"} if field
                             else {})
