"""Stage latency histograms: quantiles read back from the buckets stay close to the recorded
durations across 10 ms to 60 s, and each priority class keeps its own."""

from __future__ import annotations

import numpy as np
import redis

from keys import Priority
from keys.names import stage_latency
from workers.queue.messages import Stage
from workers.queue.metrics import stages as stage_metrics


def record(client: redis.Redis, stage: Stage, priority: Priority, seconds: list[float]) -> None:
    key = stage_latency(stage.value, priority.value)
    for s in seconds:  # what the publish script adds for each job
        client.hincrby(key, stage_metrics.bucket_field(s), 1)
        client.hincrbyfloat(key, "sum", s)
        client.hincrby(key, "count", 1)


def test_quantiles_are_within_the_bucket_resolution(redis_client: redis.Redis) -> None:
    rng = np.random.default_rng(7)
    for low, high in ((0.01, 0.05), (0.2, 1.5), (3.0, 55.0)):
        durations = [float(d) for d in np.exp(rng.uniform(np.log(low), np.log(high), 400))]
        redis_client.delete(stage_latency("denoise", "batch"))
        record(redis_client, Stage.DENOISE, Priority.BATCH, durations)
        h = stage_metrics.read(redis_client, Stage.DENOISE, Priority.BATCH)
        for q in (0.5, 0.95):
            got, want = h.quantile(q), float(np.quantile(durations, q))
            assert got is not None and abs(got - want) / want < 0.1, (low, high, q, got, want)


def test_priority_classes_are_kept_apart(redis_client: redis.Redis) -> None:
    record(redis_client, Stage.ENCODE, Priority.INTERACTIVE, [0.02] * 10)
    record(redis_client, Stage.ENCODE, Priority.BATCH, [2.0] * 10)
    fast = stage_metrics.read(redis_client, Stage.ENCODE, Priority.INTERACTIVE).quantile(0.5)
    slow = stage_metrics.read(redis_client, Stage.ENCODE, Priority.BATCH).quantile(0.5)
    assert fast is not None and fast < 0.025
    assert slow is not None and slow > 1.6
    assert stage_metrics.read(redis_client, Stage.DECODE, Priority.BATCH).quantile(0.5) is None
