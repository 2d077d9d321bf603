"""Retention against the stack no worker reads: what a sweep trims and expires, and what it
must leave alone (pending and unread stream entries, running and parked requests)."""

from __future__ import annotations

import time

import pytest
import redis

from cachesvc.waiting import wait_until
from config.settings import RetentionSettings, Settings
from keys import GenerationSpec, OutputFormat, Priority
from keys.names import (
    consumer_group,
    dead_letter_stream,
    request_index,
    request_record,
    stage_stream,
)
from tests.redis_databases import RETENTION, emptied, on_database
from workers.queue.messages import Job, Stage
from workers.queue.records import Records, initial_fields
from workers.queue.retention import Retention
from workers.queue.schema import State
from workers.queue.streams import StageQueue

TENANT = "acme"
# Every record below is either well inside or well outside this, so no test depends on timing.
RETAIN_S = 60.0
OLD, RECENT = 120.0, 5.0


@pytest.fixture
def quiet(workerless_stack: Settings) -> redis.Redis:
    """An empty Redis database of this module's own, on the stack no worker reads."""
    return emptied(on_database(workerless_stack, RETENTION))


def retention(client: redis.Redis, **overrides: float) -> Retention:
    values: dict[str, float] = {"finished_request_s": RETAIN_S, "dead_letter_s": RETAIN_S,
                                **overrides}
    return Retention(client, RetentionSettings(**values))  # type: ignore[arg-type]


def ids(client: redis.Redis, stream: str) -> list[str]:
    return [e.decode() for e, _ in client.xrange(stream)]  # type: ignore[union-attr]


def denoise_jobs(client: redis.Redis, count: int) -> tuple[StageQueue, str, list[str]]:
    """A denoise reader with its group, its stream, and the ids of ``count`` jobs added."""
    queue = StageQueue(client, Stage.DENOISE, "tester")
    queue.ensure_group()
    stream = stage_stream(Stage.DENOISE.value, Priority.INTERACTIVE.value)
    added = [client.xadd(stream, {"job": Job(f"r{n}", TENANT, Stage.DENOISE).to_json()}).decode()
             for n in range(count)]
    return queue, stream, added


def test_only_acknowledged_entries_are_trimmed(quiet: redis.Redis) -> None:
    queue, stream, added = denoise_jobs(quiet, 5)
    first, second, third = queue.next(block_ms=10, idle_timeout_ms=60_000, count=3)
    queue.ack(first)
    queue.ack(third)  # the second stays pending; the last two are unread
    # A stream no group reads yet keeps everything: its first reader will want it all.
    orphan = stage_stream(Stage.DECODE.value, Priority.BATCH.value)
    quiet.xadd(orphan, {"job": "{}"})

    report = retention(quiet).sweep()

    assert report.stream_entries == 1
    assert ids(quiet, stream) == added[1:]  # acked entries behind the pending one stay too
    assert len(ids(quiet, orphan)) == 1
    queue.ack(second)
    assert retention(quiet).sweep().stream_entries == 2
    assert ids(quiet, stream) == added[3:]  # unread
    for delivery in queue.next(block_ms=10, idle_timeout_ms=60_000, count=5):
        queue.ack(delivery)
    retention(quiet).sweep()
    assert ids(quiet, stream) == []
    # What the group has read is unchanged: a worker resumes exactly where it stopped.
    quiet.xadd(stream, {"job": Job("r5", TENANT, Stage.DENOISE).to_json()})
    [fresh] = queue.next(block_ms=10, idle_timeout_ms=60_000, count=5)
    assert fresh.job is not None and fresh.job.request_id == "r5"


def test_acknowledged_entries_stay_while_recent_if_asked(quiet: redis.Redis) -> None:
    queue, stream, added = denoise_jobs(quiet, 3)
    for delivery in queue.next(block_ms=10, idle_timeout_ms=60_000, count=3):
        queue.ack(delivery)
    # Every entry was added within the last few seconds, well inside RETAIN_S.
    assert retention(quiet, acknowledged_s=RETAIN_S).sweep().stream_entries == 0
    assert ids(quiet, stream) == added
    # Seen from RETAIN_S later, all three are old enough to go.
    later = time.time() + RETAIN_S + OLD
    assert retention(quiet, acknowledged_s=RETAIN_S).sweep(later).stream_entries == 3
    assert ids(quiet, stream) == []


def test_consumers_of_exited_workers_are_forgotten_once_idle(quiet: redis.Redis) -> None:
    gone, busy = (StageQueue(quiet, Stage.ENCODE, name) for name in ("gone", "busy"))
    gone.ensure_group()
    stream = stage_stream(Stage.ENCODE.value, Priority.INTERACTIVE.value)
    quiet.xadd(stream, {"job": Job("r0", TENANT, Stage.ENCODE).to_json()})
    assert busy.next(block_ms=10, idle_timeout_ms=60_000)  # holds its entry, unacked
    assert not gone.next(block_ms=10, idle_timeout_ms=60_000)
    sweeper = retention(quiet, dead_consumer_s=0.05)

    def names() -> set[str]:
        return {c["name"].decode() for c in quiet.xinfo_consumers(  # type: ignore[union-attr]
            stream, consumer_group(Stage.ENCODE.value))}

    def forgotten() -> bool:
        # ``gone`` read each priority's stream, so it is a consumer of each, idle from its own
        # read: one sweep may find it idle long enough in one stream and not yet in this one.
        sweeper.sweep()
        return "gone" not in names()

    wait_until(forgotten, timeout_s=10, interval_s=0.05,
               what="a sweep forgetting the idle consumer")
    assert names() == {"busy"}  # idle as long, but it holds a pending entry


def write_record(client: redis.Redis, request_id: str, state: State, submitted_ago: float,
                 changed_ago: float) -> None:
    """A record and its index entry as ``submit`` writes them, aged by hand."""
    spec = GenerationSpec.create(
        request_id=request_id, tenant=TENANT, prompt="p", width=16, height=16, num_frames=1,
        num_inference_steps=1, guidance_scale=1.0, seed=0, output_format=OutputFormat.NPY)
    now = time.time()
    client.hset(request_record(TENANT, request_id), mapping={
        **initial_fields(spec).set, "state": state.value,
        "created_at": f"{now - submitted_ago:.3f}", "updated_at": f"{now - changed_ago:.3f}"})
    client.zadd(request_index(TENANT), {request_id: int((now - submitted_ago) * 1000)})


def test_finished_records_expire_and_leave_the_index(quiet: redis.Redis) -> None:
    expired = {"done": State.DONE, "failed": State.FAILED, "cancelled": State.CANCELLED}
    kept = {"queued": State.QUEUED, "denoising": State.DENOISING, "parked": State.PREEMPTED}
    for request_id, state in {**expired, **kept}.items():
        write_record(quiet, request_id, state, OLD, OLD)
    write_record(quiet, "recent", State.DONE, OLD, RECENT)  # finished only just now
    quiet.zadd(request_index(TENANT), {"dangling": 1})  # its record was deleted by hand

    report = retention(quiet).sweep()

    assert report.records == len(expired) + 1 and not report.backlog
    records = Records(quiet)
    for request_id in expired:
        assert records.get(TENANT, request_id) is None
    left = {m.decode() for m in quiet.zrange(request_index(TENANT), 0, -1)}  # type: ignore[union-attr]
    assert left == {*kept, "recent"}
    for request_id, state in {**kept, "recent": State.DONE}.items():
        record = records.get(TENANT, request_id)
        assert record is not None and record.state is state


def test_requests_that_stay_do_not_stall_the_walk(quiet: redis.Redis) -> None:
    """A sweep examines ``sweep_batch`` requests; kept ones at the head of the index do not
    keep later sweeps from reaching the finished ones behind them."""
    for n in range(3):
        write_record(quiet, f"parked{n}", State.PREEMPTED, OLD + 10 - n, OLD)
    for n in range(2):
        write_record(quiet, f"done{n}", State.DONE, OLD - n, OLD)
    sweeper = retention(quiet, sweep_batch=2)
    reports = [sweeper.sweep() for _ in range(3)]
    assert [(r.records, r.backlog) for r in reports] == [(0, True), (1, True), (1, False)]
    assert quiet.zcard(request_index(TENANT)) == 3


def test_old_dead_letters_are_trimmed(quiet: redis.Redis) -> None:
    old_ms = int((time.time() - OLD) * 1000)
    stream = dead_letter_stream()
    quiet.xadd(stream, {"job": "{}", "reason": "old"}, id=f"{old_ms}-0")
    quiet.xadd(stream, {"job": "{}", "reason": "old"}, id=f"{old_ms}-1")
    recent = quiet.xadd(stream, {"job": "{}", "reason": "recent"}).decode()
    assert retention(quiet).sweep().dead_letters == 2
    assert ids(quiet, stream) == [recent]
