"""Dispatch rate of the queue contract: jobs per second through the three streams when the
stage bodies do nothing. Every dispatch still takes the full path (read, fenced claim, lease,
publish of the next job, state, latency and ack in one script) on Valkey with
``appendfsync always``, with workers batching up to ``BATCH`` jobs per round trip.
"""

from __future__ import annotations

import argparse
import time

from bench.common import NOOP_GO, bench_stack, report, start_noop_workers, stop_processes
from cachesvc.connect import open_redis
from keys import GenerationSpec, OutputFormat
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.streams import StageQueue, queue_counts
from workers.queue.submit import new_request_id, submit

BATCH = 32  # workers.batch_size: jobs read, fenced and published per round trip


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
        procs = start_noop_workers(settings, BATCH)
        records = Records(client)
        start = time.perf_counter()
        client.set(NOOP_GO, 1)
        decode = StageQueue(client, Stage.DECODE, "bench")
        # Cheap to poll: the decode group has read every job and acknowledged them all.
        while decode.read_count() < len(specs) or any(
                in_flight for (stage, _), (_, in_flight) in queue_counts(client).items()
                if stage is Stage.DECODE):
            time.sleep(0.005)
        elapsed = time.perf_counter() - start
        assert all(r is not None and r.state is State.DONE
                   for r in (records.get("bench", s.request_id) for s in specs))
        stop_processes(procs)
    dispatches = 3 * args.requests
    per_s = dispatches / elapsed
    report("No-op dispatch through encode, denoise and decode streams",
           ["requests", "dispatches", "seconds", "per second"],
           [[args.requests, dispatches, elapsed, per_s]],
           {"bench": "dispatch", "per_s": round(per_s, 1)})


if __name__ == "__main__":
    main()
