"""Stream order and decode credits, driven by hand on the stack that no worker reads."""

from __future__ import annotations

import pytest
import redis

from cachesvc.settings import Settings
from keys import Priority
from keys.names import request_record, stage_stream
from tests.redis_databases import STREAMS, emptied, on_database
from workers.queue.credits import Credits
from workers.queue.messages import Job, Stage
from workers.queue.streams import StageQueue


@pytest.fixture
def quiet(workerless_stack: Settings) -> redis.Redis:
    """An empty Redis database of this module's own, on the stack no worker reads."""
    return emptied(on_database(workerless_stack, STREAMS))


def test_workers_take_interactive_work_first(quiet: redis.Redis) -> None:
    queue = StageQueue(quiet, Stage.DENOISE, "tester")
    queue.ensure_group()
    for n, priority in enumerate([Priority.BATCH, Priority.BATCH, Priority.INTERACTIVE]):
        job = Job(f"r{n}", "acme", Stage.DENOISE, priority=priority)
        quiet.xadd(stage_stream(Stage.DENOISE.value, priority.value),
                          {"job": job.to_json()})
    taken = [[d.job.request_id for d in queue.next(block_ms=10, idle_timeout_ms=60_000,
                                                   count=1) if d.job] for _ in range(3)]
    assert taken == [["r2"], ["r0"], ["r1"]]  # the interactive job first, alone


def test_credits_bound_trajectories_and_abandoned_ones_give_theirs_back(
        quiet: redis.Redis) -> None:
    credits = Credits(quiet, limit=1)
    for request_id in ("a", "b"):
        quiet.hset(request_record("acme", request_id), "state", "DENOISING")
    assert credits.acquire("acme", "a", 1)
    assert credits.acquire("acme", "a", 2)  # a redelivery of the holder keeps its credit
    assert not credits.acquire("acme", "b", 3)
    quiet.hset(request_record("acme", "a"), "state", "FAILED")  # abandoned
    assert credits.acquire("acme", "b", 4)
    credits.release("acme", "b")
    assert credits.holders() == 0
