"""Adapter-aware routing: a job goes to the inbox of the live worker running (or holding) its
adapters, that worker reads its inbox before shared batch work, and a routed job its worker does
not take within ``affinity_wait_ms`` goes to any worker."""

from __future__ import annotations

import time

import redis

from cachesvc.waiting import wait_until
from keys.names import stage_stream, worker_heartbeats, worker_inbox
from workers.queue.affinity import AdapterRouter
from workers.queue.messages import Job, Stage
from workers.queue.metrics.adapters import WorkerAdapters, publish_adapter_stats
from workers.queue.streams import StageQueue

H1, H2, H3 = "1" * 32, "2" * 32, "3" * 32


def beat(client: redis.Redis, consumer: str, age_s: float = 0.0) -> None:
    client.zadd(worker_heartbeats(Stage.DENOISE.value),
                {consumer: int((time.time() - age_s) * 1000)})


def test_a_job_goes_to_the_worker_running_or_holding_its_adapters(
        redis_client: redis.Redis) -> None:
    publish_adapter_stats(redis_client, WorkerAdapters("w1", 1, 1, 0.1, (H1,), (H1,)))
    publish_adapter_stats(redis_client, WorkerAdapters("w2", 2, 3, 0.2, (H1, H2), (H2,)))
    beat(redis_client, "w1")
    beat(redis_client, "w2")
    try:
        router = AdapterRouter(redis_client, live_within_s=10)
        assert router.inbox_for([H1]) == worker_inbox("denoise", "w1")  # runs exactly H1
        assert router.inbox_for([H2]) == worker_inbox("denoise", "w2")
        assert router.inbox_for([H3]) is None  # nobody has it: the shared stream
        assert router.inbox_for([]) is None
        beat(redis_client, "w1", age_s=60)  # w1 went silent: w2 holds H1 too
        assert router.inbox_for([H1]) == worker_inbox("denoise", "w2")
    finally:  # fake workers, not live ones: the next test may empty this database
        redis_client.delete(worker_heartbeats(Stage.DENOISE.value))


def test_a_worker_reads_its_inbox_first_and_others_take_what_waits_too_long(
        redis_client: redis.Redis) -> None:
    mine = StageQueue(redis_client, Stage.DENOISE, "mine", inbox_wait_ms=300)
    other = StageQueue(redis_client, Stage.DENOISE, "other", inbox_wait_ms=300)
    mine.ensure_group()
    other.ensure_group()
    batch = Job("shared", "t", Stage.DENOISE)
    routed = Job("routed", "t", Stage.DENOISE)
    redis_client.xadd(stage_stream("denoise", "batch"), {"job": batch.to_json()})
    redis_client.xadd(worker_inbox("denoise", "mine"), {"job": routed.to_json()})

    def take(queue: StageQueue) -> list[Job | None]:
        got = queue.next(block_ms=10, idle_timeout_ms=400)  # looks for stale work every 0.1 s
        for delivery in got:
            queue.ack(delivery)
        return [d.job for d in got]

    assert take(mine) == [routed]  # its inbox before shared batch work
    waiting = Job("waiting", "t", Stage.DENOISE)
    redis_client.xadd(worker_inbox("denoise", "mine"), {"job": waiting.to_json()})
    assert take(other) == [batch]  # not ``mine``'s job while it is fresh
    # ``mine`` takes nothing more; past affinity_wait_ms the other worker takes its job.
    taken = wait_until(lambda: take(other), timeout_s=10, interval_s=0.05,
                       what="the waiting routed job taken")
    assert taken == [waiting]


def test_an_inbox_entry_left_pending_by_a_worker_that_died_is_taken_over(
        redis_client: redis.Redis) -> None:
    # A routed job its worker read and then died holding: no unread entry is left for the
    # stale-inbox path, so only the takeover of silent consumers can find it.
    dead = StageQueue(redis_client, Stage.DENOISE, "dead", inbox_wait_ms=300)
    alive = StageQueue(redis_client, Stage.DENOISE, "alive", inbox_wait_ms=300)
    dead.ensure_group()
    alive.ensure_group()
    routed = Job("routed", "t", Stage.DENOISE)
    redis_client.xadd(worker_inbox("denoise", "dead"), {"job": routed.to_json()})
    (read,) = dead.next(block_ms=10, idle_timeout_ms=400)
    assert read.job == routed and read.attempt == 1
    taken = wait_until(lambda: alive.next(block_ms=10, idle_timeout_ms=400), timeout_s=10,
                       interval_s=0.05, what="the dead worker's routed job taken over")
    assert [(d.job, d.stream, d.attempt) for d in taken] == [
        (routed, worker_inbox("denoise", "dead"), 2)]  # a new attempt: the fence moves on


def test_a_worker_recovering_from_a_redis_error_takes_up_its_own_inbox_entries(
        redis_client: redis.Redis) -> None:
    mine = StageQueue(redis_client, Stage.DENOISE, "mine", inbox_wait_ms=300)
    mine.ensure_group()
    routed = Job("routed", "t", Stage.DENOISE)
    redis_client.xadd(worker_inbox("denoise", "mine"), {"job": routed.to_json()})
    (read,) = mine.next(block_ms=10, idle_timeout_ms=60_000)
    (again,) = mine.own_pending(count=1)
    assert (again.job, again.stream, again.attempt) == (routed, read.stream, 2)
