"""The watchdog: a request still in flight with neither a live owner nor an entry anyone will
deliver is re-queued at encode under its next generation, counted and exported; one that has
an owner, an unread entry, or a takeover still to come is left alone."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import generate_latest

from api.metrics import ClusterCollector, registry_with
from cachesvc.waiting import wait_until
from keys import GenerationSpec
from keys.names import (
    consumer_group,
    decode_credits,
    request_record,
    stage_stream,
    worker_heartbeats,
)
from tests.workers_harness import make_spec
from workers.queue.cluster_view import ClusterView
from workers.queue.credits import Credits
from workers.queue.messages import Job, Stage
from workers.queue.records import Records
from workers.queue.schema import Field, State
from workers.queue.streams import StageQueue
from workers.queue.submit import submit
from workers.queue.watchdog import Rescue, RescueReason, Watchdog, read_rescued

ENCODE_GROUP = consumer_group(Stage.ENCODE.value)


@pytest.fixture
def db(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """The test's database; the fake heartbeats go with the test, so that the next one may
    empty the database (which refuses while workers seem to live in it)."""
    yield redis_client
    for stage in Stage:
        redis_client.delete(worker_heartbeats(stage.value))


def beat(client: redis.Redis, stage: Stage, consumer: str) -> None:
    client.zadd(worker_heartbeats(stage.value), {consumer: int(time.time() * 1000)})


def encode_stream(spec: GenerationSpec) -> str:
    return stage_stream(Stage.ENCODE.value, spec.priority.value)


def taken_by(client: redis.Redis, spec: GenerationSpec, consumer: str) -> None:
    """``consumer`` reads the request's encode entry and never acknowledges it."""
    got = client.xreadgroup(ENCODE_GROUP, consumer, {encode_stream(spec): ">"}, count=1)
    assert got, "nothing to read"


def submitted(client: redis.Redis, seed: int) -> GenerationSpec:
    """A request just accepted, its entry in the encode stream, whose group workers read."""
    StageQueue(client, Stage.ENCODE, "alive").ensure_group()
    spec = make_spec(tenant="watch", seed=seed)
    submit(client, spec)
    return spec


def test_a_request_parked_under_a_consumer_that_never_existed_is_rescued(db: redis.Redis) -> None:
    spec = submitted(db, seed=1)
    taken_by(db, spec, "never-existed")
    credits = Credits(db, limit=8)
    assert credits.acquire(spec.tenant, spec.request_id, int(time.time() * 1000))
    beat(db, Stage.ENCODE, "alive")  # a live worker that did not take it over
    dog = Watchdog(db, orphan_after_s=0.2, live_within_s=60)

    rescued = wait_until(lambda: dog.patrol().rescued, timeout_s=10, interval_s=0.05,
                         what="the parked request rescued")
    assert rescued == (Rescue("watch", spec.request_id, Stage.ENCODE,
                              RescueReason.DEAD_CONSUMER),)
    record = Records(db).get(spec.tenant, spec.request_id)
    assert record is not None and record.state is State.QUEUED
    assert record.generation == 1 and record.counter(Field.RESCUES) == 1
    # The dead entry is acknowledged, its credit given back, and a new entry of the next
    # generation waits where any encode worker reads.
    assert db.xpending(encode_stream(spec), ENCODE_GROUP)["pending"] == 0
    assert db.zscore(decode_credits(),
                               request_record(spec.tenant, spec.request_id)) is None
    got = db.xreadgroup(ENCODE_GROUP, "alive", {encode_stream(spec): ">"})
    (entry_id, fields), = got[0][1]
    job = Job.from_json(fields[b"job"])
    assert (job.request_id, job.stage, job.generation) == (spec.request_id, Stage.ENCODE, 1)
    db.xack(encode_stream(spec), ENCODE_GROUP, entry_id)
    # Counted cluster-wide and exported.
    assert read_rescued(db) == {(Stage.ENCODE, RescueReason.DEAD_CONSUMER): 1}
    text = generate_latest(registry_with(ClusterCollector(ClusterView(db)))).decode()
    assert 'diffcache_requests_rescued_total{reason="dead_consumer",stage="encode"} 1.0' in text


def test_a_request_with_no_entry_anywhere_is_rescued(db: redis.Redis) -> None:
    spec = submitted(db, seed=2)
    got = db.xreadgroup(ENCODE_GROUP, "ghost", {encode_stream(spec): ">"}, count=1)
    db.xack(encode_stream(spec), ENCODE_GROUP, got[0][1][0][0])  # its entry is gone
    dog = Watchdog(db, orphan_after_s=0.0, live_within_s=60)
    assert dog.patrol().rescued == (Rescue("watch", spec.request_id, Stage.ENCODE,
                                           RescueReason.NO_ENTRY),)
    assert dog.patrol().rescued == ()  # its new entry waits unread: delivered in time


def test_owned_waiting_and_unworked_requests_are_left_alone(db: redis.Redis) -> None:
    unread = submitted(db, seed=3)  # noqa: F841 -- waits in the stream, unread
    held = submitted(db, seed=4)
    taken_by(db, held, "alive")  # held by a worker whose heartbeat is fresh
    beat(db, Stage.ENCODE, "alive")
    dog = Watchdog(db, orphan_after_s=0.0, live_within_s=60)
    assert dog.patrol().rescued == ()
    # Pending under a dead worker while no worker of the stage lives: there is nobody a
    # takeover could have come from, so that is capacity, not a lost job.
    db.delete(worker_heartbeats(Stage.ENCODE.value))
    assert dog.patrol().rescued == ()
    # With a live worker, a dead owner's entry is rescued only once it has idled past the
    # bound that leaves takeover the first chance.
    beat(db, Stage.ENCODE, "other")
    patient = Watchdog(db, orphan_after_s=3600, live_within_s=60)
    assert patient.patrol().rescued == ()
    assert read_rescued(db) == {}
