"""The scaling signals on ``/metrics``: queue depth, in-flight count and the oldest waiting age
per stage and class, read from the streams of a Redis database no worker uses."""

from __future__ import annotations

import redis

from api.metrics import ClusterCollector, registry_with
from cachesvc.waiting import wait_until
from keys import GenerationSpec, OutputFormat, Priority
from keys.names import stage_stream
from workers.queue.cluster_view import ClusterView
from workers.queue.messages import Stage
from workers.queue.streams import StageQueue
from workers.queue.submit import submit

TENANT = "scaling"
# Between the first and the second submission, and before the scrape: ages then differ by more
# than a scrape takes, so the oldest waiting entry cannot be confused with the one taken, and no
# age passes for 0 by chance.
GAP_MS = 200
SIGNALS = ("diffcache_queue_depth", "diffcache_queue_in_flight",
           "diffcache_queue_oldest_waiting_seconds")


def spec(request_id: str, priority: Priority) -> GenerationSpec:
    return GenerationSpec.create(
        request_id=request_id, tenant=TENANT, prompt="p", width=16, height=16, num_frames=1,
        num_inference_steps=1, guidance_scale=1.0, seed=0, output_format=OutputFormat.NPY,
        priority=priority)


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def entry_ms(client: redis.Redis, priority: Priority, index: int) -> int:
    entries = client.xrange(stage_stream(Stage.ENCODE.value, priority.value))
    return int(entries[index][0].decode().partition("-")[0])


def scrape(client: redis.Redis) -> dict[tuple[str, str, str], float]:
    """(metric, stage, priority) -> value, as a Prometheus scrape of the API would read them."""
    registry = registry_with(ClusterCollector(ClusterView(client)))
    return {(s.name, s.labels["stage"], s.labels["priority"]): s.value
            for family in registry.collect() for s in family.samples if s.name in SIGNALS}


def test_depth_in_flight_and_oldest_waiting_age_per_stage_and_class(
        redis_client: redis.Redis) -> None:
    queues = {stage: StageQueue(redis_client, stage, "scaler") for stage in Stage}
    for queue in queues.values():
        queue.ensure_group()
    assert set(scrape(redis_client).values()) == {0}  # every stage and class, all zero

    submit(redis_client, spec("i0", Priority.INTERACTIVE))
    first = entry_ms(redis_client, Priority.INTERACTIVE, 0)
    wait_until(lambda: redis_ms(redis_client) > first + GAP_MS, timeout_s=5,
               what="the Redis clock to pass the first entry")
    for request_id in ("i1", "i2"):
        submit(redis_client, spec(request_id, Priority.INTERACTIVE))
    submit(redis_client, spec("b0", Priority.BATCH))
    taken = queues[Stage.ENCODE].next(block_ms=10, idle_timeout_ms=60_000, count=1)
    assert [d.job.request_id for d in taken if d.job] == ["i0"]

    # i1 is now the oldest entry no worker has taken, not i0 (taken) or i2 (younger).
    second, batch = (entry_ms(redis_client, Priority.INTERACTIVE, 1),
                     entry_ms(redis_client, Priority.BATCH, 0))
    wait_until(lambda: redis_ms(redis_client) > batch + GAP_MS, timeout_s=5,
               what="the Redis clock to pass the last entry")
    before = redis_ms(redis_client)
    values = scrape(redis_client)
    after = redis_ms(redis_client)
    interactive = ("encode", "interactive")
    assert values[("diffcache_queue_depth", *interactive)] == 3
    assert values[("diffcache_queue_in_flight", *interactive)] == 1
    age = values[("diffcache_queue_oldest_waiting_seconds", *interactive)]
    assert GAP_MS / 1000 < (before - second) / 1000 <= age <= (after - second) / 1000
    assert values[("diffcache_queue_depth", "encode", "batch")] == 1
    assert values[("diffcache_queue_in_flight", "encode", "batch")] == 0
    age = values[("diffcache_queue_oldest_waiting_seconds", "encode", "batch")]
    assert (before - batch) / 1000 <= age <= (after - batch) / 1000
    rest = {k: v for k, v in values.items() if k[1:] not in (interactive, ("encode", "batch"))}
    assert len(rest) == 3 * (len(Stage) * len(Priority) - 2) and set(rest.values()) == {0}

    # Taken but not acknowledged: in flight, and nothing of that class waits any more.
    for _ in range(2):  # interactive entries come alone, then the batch one
        taken += queues[Stage.ENCODE].next(block_ms=10, idle_timeout_ms=60_000, count=3)
    assert sorted(d.job.request_id for d in taken if d.job) == ["b0", "i0", "i1", "i2"]
    values = scrape(redis_client)
    for priority, in_flight in (("interactive", 3), ("batch", 1)):
        assert values[("diffcache_queue_depth", "encode", priority)] == in_flight
        assert values[("diffcache_queue_in_flight", "encode", priority)] == in_flight
        assert values[("diffcache_queue_oldest_waiting_seconds", "encode", priority)] == 0
    for delivery in taken:
        queues[Stage.ENCODE].ack(delivery)
    assert set(scrape(redis_client).values()) == {0}
