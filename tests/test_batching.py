"""Workers that batch (``workers.batch_size`` > 1) keep the queue contract: every job is fenced,
run and published exactly once, with its latency counted. Uses the stack without workers, so
that the session's real workers do not take these jobs."""

from __future__ import annotations

import threading

import redis

from bench.common import NoOp
from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from config.settings import Settings, WorkerSettings
from keys import GenerationSpec, OutputFormat, Priority
from keys.names import stage_stream
from tests.redis_databases import BATCHING, emptied, on_database
from workers.queue.messages import Stage
from workers.queue.metrics import stages as stage_metrics
from workers.queue.records import Records
from workers.queue.runtime import Worker
from workers.queue.schema import State
from workers.queue.submit import new_request_id, submit


def test_batched_workers_publish_every_job_exactly_once(workerless_stack: Settings) -> None:
    settings = on_database(workerless_stack, BATCHING)  # a database only this test's workers use
    client: redis.Redis = emptied(settings)
    specs = [GenerationSpec.create(request_id=new_request_id(), tenant="acme", prompt=f"p{i}",
                                   width=16, height=16, num_frames=1, num_inference_steps=1,
                                   guidance_scale=1.0, seed=i, output_format=OutputFormat.NPY)
             for i in range(40)]
    for spec in specs:
        submit(client, spec)
    workers = [Worker(NoOp(stage), open_redis(settings),
                      WorkerSettings(block_ms=50, batch_size=8)) for stage in Stage]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    records = Records(client)
    wait_until(lambda: all(r is not None and r.state is State.DONE
                           for r in (records.get("acme", s.request_id) for s in specs)),
               timeout_s=60, interval_s=0.05, what=f"all {len(specs)} requests DONE")
    for w in workers:
        w.stop.set()
    for t in threads:
        t.join(10)
    for stage in (Stage.DENOISE, Stage.DECODE):
        # each handed on once
        assert client.xlen(stage_stream(stage.value, "interactive")) == len(specs)
    for stage in Stage:
        assert sum(stage_metrics.read(client, stage, p).count for p in Priority) == len(specs)
        assert client.xpending(stage_stream(stage.value, "interactive"), f"{stage.value}-workers")[
            "pending"] == 0
