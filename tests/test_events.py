"""Record notifications: every script that writes a record wakes its followers, and a follower
of a request where nothing happens costs Redis nothing until its fallback reread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from keys import GenerationSpec, OutputFormat
from workers.queue.events import RecordEvents
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.submit import submit

TENANT = "events"


def spec(request_id: str) -> GenerationSpec:
    return GenerationSpec.create(
        request_id=request_id, tenant=TENANT, prompt="p", width=16, height=16, num_frames=1,
        num_inference_steps=1, guidance_scale=1.0, seed=0, output_format=OutputFormat.NPY)


@pytest.fixture
def events(redis_client: redis.Redis) -> Iterator[RecordEvents]:
    events = RecordEvents(redis_client, fallback_s=30)
    yield events
    events.close()


def test_a_script_write_wakes_the_requests_watchers(redis_client: redis.Redis,
                                                    events: RecordEvents) -> None:
    submit(redis_client, spec("woken"))
    woken = threading.Event()
    with events.watching(TENANT, "woken", woken.set):
        # The subscription is in place when ``watching`` returns: nothing can be missed.
        assert Records(redis_client).cancel(TENANT, "woken")
        assert woken.wait(10)


def test_follow_yields_each_change_until_the_request_ends(redis_client: redis.Redis,
                                                          events: RecordEvents) -> None:
    submit(redis_client, spec("followed"))
    seen = []
    for record in events.follow(TENANT, "followed", timeout_s=10):
        seen.append(record.state)
        if record.state is State.QUEUED:
            Records(redis_client).cancel(TENANT, "followed")
    assert seen == [State.QUEUED, State.CANCELLED]


def test_an_idle_follower_reads_nothing_until_its_fallback(redis_client: redis.Redis,
                                                           events: RecordEvents) -> None:
    submit(redis_client, spec("idle"))
    with events.watching(TENANT, "warm-up", lambda: None):
        pass  # the subscriber's connection is set up once, with commands of its own
    before = int(redis_client.info("stats")["total_commands_processed"])
    with pytest.raises(TimeoutError, match="idle not finished within 1"):
        for _ in events.follow(TENANT, "idle", timeout_s=1):
            pass
    spent = int(redis_client.info("stats")["total_commands_processed"]) - before
    # Subscribe, the first read, the read at the deadline, unsubscribe, and this INFO, plus
    # counting itself in and out as a watcher (a script each, of two commands): a follower
    # that polled would have read the record tens of times.
    assert spent <= 11


def test_following_a_missing_request_says_so(events: RecordEvents) -> None:
    with pytest.raises(KeyError, match="missing"):
        next(events.follow(TENANT, "missing"))
