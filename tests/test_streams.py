"""Stream order and decode credits, driven by hand on the stack that no worker reads."""

from __future__ import annotations

import json

import pytest
import redis

from bench.common import NoOp
from config.settings import Settings, WorkerSettings
from keys import GenerationSpec, OutputFormat, Priority
from keys.names import consumer_group, dead_letter_stream, request_record, stage_stream
from tests.redis_databases import STREAMS, emptied, on_database
from workers.queue.credits import Credits
from workers.queue.messages import MESSAGE_VERSION, Job, Stage
from workers.queue.record_write import RecordWrite
from workers.queue.records import Records
from workers.queue.runtime import Worker
from workers.queue.schema import StageField, State
from workers.queue.script_library import Result
from workers.queue.streams import StageQueue
from workers.queue.submit import submit


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


def test_a_read_with_a_claim_fences_each_job_as_it_takes_it(quiet: redis.Redis) -> None:
    """The fused read (lua/take.lua) claims exactly what a read then a claim would: the
    record built in Lua is request_record's, first in class order, a job it cannot read left
    unclaimed, a record that is gone answered MISSING, and a stale token refused."""
    records = Records(quiet)
    queue = StageQueue(quiet, Stage.ENCODE, "tester")
    queue.ensure_group()
    claim = RecordWrite({StageField.WORKER.of(Stage.ENCODE): "tester"})
    for n, priority in enumerate([Priority.BATCH, Priority.INTERACTIVE, Priority.INTERACTIVE]):
        spec = GenerationSpec.create(
            request_id=f"take-{n}", tenant="acme", prompt="p", width=16, height=16,
            num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=0,
            output_format=OutputFormat.NPY, priority=priority)
        submit(quiet, spec)
    quiet.delete(request_record("acme", "take-2"))  # its record expired meanwhile
    stream = stage_stream(Stage.ENCODE.value, Priority.INTERACTIVE.value)
    quiet.xadd(stream, {"job": "not json"})
    taken = queue.next(block_ms=None, idle_timeout_ms=60_000, count=8, claim=claim)
    assert [(d.job.request_id if d.job else None, d.claim) for d in taken] == [
        ("take-1", Result.OK), ("take-2", Result.MISSING), (None, None)]
    record = records.get("acme", "take-1")
    assert record is not None and record.state is State.ENCODING
    assert quiet.hget(request_record("acme", "take-1"),
                      StageField.WORKER.of(Stage.ENCODE)) == b"tester"
    assert quiet.hget(request_record("acme", "take-1"),
                      StageField.FENCE.of(Stage.ENCODE)) == b"1"
    # The batch job comes next, alone; then nothing is there, and nothing blocks.
    batch = queue.next(block_ms=None, idle_timeout_ms=60_000, count=8, claim=claim)
    assert [(d.job.request_id, d.claim) for d in batch if d.job] == [("take-0", Result.OK)]
    assert queue.next(block_ms=None, idle_timeout_ms=60_000, count=8, claim=claim) == []
    # A newer attempt holds take-0 now: a claim with the first attempt's token is stale.
    quiet.hset(request_record("acme", "take-0"), StageField.FENCE.of(Stage.ENCODE), 5)
    job = batch[0].job
    assert job is not None
    quiet.xadd(stage_stream(Stage.ENCODE.value, Priority.BATCH.value), {"job": job.to_json()})
    again = queue.next(block_ms=None, idle_timeout_ms=60_000, count=8, claim=claim)
    assert [d.claim for d in again] == [Result.STALE]


def test_a_claimed_job_this_release_cannot_read_fails_its_request(quiet: redis.Redis) -> None:
    """An entry the fused read can claim but the worker cannot read as a Job (a release that
    wrote another shape of job) fails its request with the reason, through the dead letters,
    rather than leaving it claimed by a live worker that never runs it."""
    spec = GenerationSpec.create(
        request_id="unreadable", tenant="acme", prompt="p", width=16, height=16,
        num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=0,
        output_format=OutputFormat.NPY)
    submit(quiet, spec)
    stream = stage_stream(Stage.ENCODE.value, spec.priority.value)
    quiet.delete(stream)  # its readable entry: this test offers the unreadable one instead
    worker = Worker(NoOp(Stage.ENCODE), quiet, WorkerSettings())
    worker.queue.ensure_group()
    quiet.xadd(stream, {"job": json.dumps({"request_id": "unreadable", "tenant": "acme",
                                           "stage": "no-such-stage", "v": 1})})
    taken = worker.read(None, 60_000, 8)
    assert [(d.job, d.claim) for d in taken] == [(None, Result.OK)]
    assert worker.claim(taken) == []
    record = Records(quiet).get("acme", "unreadable")
    assert record is not None and record.state is State.FAILED
    assert record.error is not None and "cannot read its job" in record.error
    assert quiet.xlen(dead_letter_stream()) == 1
    assert quiet.xpending(stream, consumer_group(Stage.ENCODE.value))["pending"] == 0
    worker.leases.close()


def test_a_batch_of_publishes_acknowledges_each_delivery_it_publishes(
        quiet: redis.Redis) -> None:
    """``publish`` defers its acknowledgements to the end of a batch (one XACK per stream and
    group): every published delivery is acknowledged and its seconds are on its record, while
    a result whose attempt went stale is refused and its delivery stays pending."""
    worker = Worker(NoOp(Stage.ENCODE), quiet, WorkerSettings())
    worker.queue.ensure_group()
    for n, priority in enumerate([Priority.BATCH, Priority.BATCH, Priority.BATCH]):
        submit(quiet, GenerationSpec.create(
            request_id=f"pub-{n}", tenant="acme", prompt="p", width=16, height=16,
            num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=n,
            output_format=OutputFormat.NPY, priority=priority))
    owned = worker.claim(worker.read(None, 60_000, 8))
    assert [job.request_id for job, _ in owned] == ["pub-0", "pub-1", "pub-2"]
    # A newer attempt took pub-1 over meanwhile: its result is stale.
    quiet.hset(request_record("acme", "pub-1"), StageField.FENCE.of(Stage.ENCODE), 5)
    results = [r for job, d in owned if (r := worker._run(job, d)) is not None]
    worker.settle(results)
    stream = stage_stream(Stage.ENCODE.value, Priority.BATCH.value)
    pending = quiet.xpending_range(stream, consumer_group(Stage.ENCODE.value), "-", "+", 8)
    assert [p["message_id"].decode() for p in pending] == [owned[1][1].entry_id]
    records = Records(quiet)
    for n, state in ((0, State.ENCODED), (1, State.ENCODING), (2, State.ENCODED)):
        record = records.get("acme", f"pub-{n}")
        assert record is not None and record.state is state
        seconds = record.fields.get(StageField.SECONDS.of(Stage.ENCODE))
        assert (seconds is not None) is (state is State.ENCODED)
    worker.leases.close()


def test_a_publish_takes_the_next_read_in_the_same_round_trip(quiet: redis.Redis) -> None:
    """A busy worker publishes a batch and takes its next in one round trip: what ``process``
    hands back is the next read, claimed as ``next`` would claim it, interactive work first,
    and the published jobs' entries carry the header their claim reads (``add_job``)."""
    worker = Worker(NoOp(Stage.ENCODE), quiet, WorkerSettings())
    worker.queue.ensure_group()
    worker.queue.next(block_ms=None, idle_timeout_ms=60_000, count=1)  # its look for stale work
    for n, priority in enumerate([Priority.BATCH, Priority.BATCH, Priority.INTERACTIVE]):
        submit(quiet, GenerationSpec.create(
            request_id=f"ahead-{n}", tenant="acme", prompt="p", width=16, height=16,
            num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=n,
            output_format=OutputFormat.NPY, priority=priority))
    first = worker.read(None, 60_000, 1)
    assert [d.job.request_id for d in first if d.job] == ["ahead-2"]
    ahead = worker.process(first, take=8)
    assert [(d.job.request_id if d.job else None, d.claim) for d in ahead] == [
        ("ahead-0", Result.OK), ("ahead-1", Result.OK)]
    record = Records(quiet).get("acme", "ahead-0")
    assert record is not None and record.state is State.ENCODING
    assert worker.process(ahead, take=8) == []  # nothing left to take
    entries = quiet.xrange(stage_stream(Stage.DENOISE.value, Priority.BATCH.value))
    assert [(f[b"record"], f[b"gen"], f[b"v"]) for _, f in entries] == [
        (request_record("acme", f"ahead-{n}").encode(), b"0", str(MESSAGE_VERSION).encode())
        for n in (0, 1)]
    worker.leases.close()


def test_an_entry_whose_header_names_another_message_version_is_left_unclaimed(
        quiet: redis.Redis) -> None:
    """The claim trusts an entry's header over its JSON: one written by a release with another
    message version is not claimed, whatever its job says."""
    spec = GenerationSpec.create(
        request_id="other-release", tenant="acme", prompt="p", width=16, height=16,
        num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=0,
        output_format=OutputFormat.NPY)
    submit(quiet, spec)
    stream = stage_stream(Stage.ENCODE.value, spec.priority.value)
    quiet.delete(stream)  # its entry has this release's header: offer the other instead
    queue = StageQueue(quiet, Stage.ENCODE, "tester")
    queue.ensure_group()
    job = Job("other-release", "acme", Stage.ENCODE)
    quiet.xadd(stream, {"job": job.to_json(), "v": MESSAGE_VERSION + 1,
                        "record": request_record("acme", "other-release"), "gen": 0})
    taken = queue.next(block_ms=None, idle_timeout_ms=60_000, count=8,
                       claim=RecordWrite({StageField.WORKER.of(Stage.ENCODE): "tester"}))
    assert [d.claim for d in taken] == [None]
    record = Records(quiet).get("acme", "other-release")
    assert record is not None and record.state is State.QUEUED
