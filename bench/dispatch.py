"""Dispatch rate of the queue contract: jobs per second through the three streams when the
stage bodies do nothing. Every dispatch still takes the full path (read, fenced claim, lease,
publish of the next job, state, latency and ack in one script) on Valkey with
``appendfsync always``, with workers batching up to ``BATCH`` jobs per round trip.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from bench.common import bench_stack, report
from cachesvc.connect import open_redis
from cachesvc.settings import Settings, WorkerSettings
from keys import GenerationSpec, OutputFormat
from workers.messages import NEXT, Stage, State
from workers.records import Records
from workers.runtime import JobContext, Outcome, Worker
from workers.streams import StageQueue, queue_counts
from workers.submit import new_request_id, submit


class NoOp:
    """A stage body that does no work: it only hands the job on."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def handle(self, ctx: JobContext) -> Outcome:
        following = NEXT[self.stage]
        job = ctx.job
        return Outcome(None if following is None else job.handoff(following, ()))

    def discard(self, outcome: Outcome) -> None:
        """Nothing was written."""


READY, GO = "bench:dispatch:ready", "bench:dispatch:go"
BATCH = 32  # workers.batch_size: jobs read, fenced and published per round trip


def run_noop(stage: Stage, settings: Settings) -> None:
    """A worker process whose stage body does nothing; it starts when the bench says go."""
    client = open_redis(settings)
    worker = Worker(NoOp(stage), client, WorkerSettings(block_ms=50, batch_size=BATCH))
    client.incr(READY)
    while not client.exists(GO):
        time.sleep(0.001)
    worker.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    with bench_stack(segment_mib=64) as settings:
        client = open_redis(settings)
        # Accept every request first: acceptance (fsynced, one at a time) is not dispatch.
        specs = [GenerationSpec.create(
            request_id=new_request_id(), tenant="bench", prompt=f"p{i}", width=16, height=16,
            num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=i,
            output_format=OutputFormat.NPY) for i in range(args.requests)]
        for spec in specs:
            submit(client, spec)
        # One process per stage, as in a deployment: no stage waits on another's GIL.
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_noop, args=(stage, settings), daemon=True)
                 for stage in Stage]
        for p in procs:
            p.start()
        while int(client.get(READY) or 0) < len(procs):
            time.sleep(0.01)
        records = Records(client)
        start = time.perf_counter()
        client.set(GO, 1)
        decode = StageQueue(client, Stage.DECODE, "bench")
        # Cheap to poll: the decode group has read every job and acknowledged them all.
        while decode.read_count() < len(specs) or any(
                in_flight for (stage, _), (_, in_flight) in queue_counts(client).items()
                if stage is Stage.DECODE):
            time.sleep(0.005)
        elapsed = time.perf_counter() - start
        assert all(r is not None and r.state is State.DONE
                   for r in (records.get("bench", s.request_id) for s in specs))
        for p in procs:
            p.terminate()
            p.join()
    dispatches = 3 * args.requests
    per_s = dispatches / elapsed
    report("No-op dispatch through encode, denoise and decode streams",
           ["requests", "dispatches", "seconds", "per second"],
           [[args.requests, dispatches, elapsed, per_s]],
           {"bench": "dispatch", "per_s": round(per_s, 1)})


if __name__ == "__main__":
    main()
