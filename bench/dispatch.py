"""Dispatch rate of the queue contract: jobs per second through the three streams when the
stage bodies do nothing. Every dispatch still takes the full path (read, fenced claim, lease,
publish of the next job, state, latency and ack in one script) on Valkey with
``appendfsync always``, with workers batching up to ``BATCH`` jobs per round trip.

In the same run, on the same Valkey, rounds alternate with the raw Redis work a dispatch cannot
avoid (``bench.raw_dispatch``), so the ratio between the two holds on any disk and machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import redis

from bench import raw_dispatch
from bench.common import (
    NOOP_GO,
    bench_stack,
    report,
    run_noop,
    start_noop_workers,
    stop_processes,
)
from cachesvc.connect import open_redis
from cachesvc.settings import Settings
from cachesvc.waiting import wait_until
from keys import GenerationSpec, OutputFormat
from keys.names import request_record
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.streams import StageQueue
from workers.queue.submit import new_request_id, submit

BATCH = 32  # workers.batch_size: jobs read, fenced and published per round trip
TENANT = "bench"


def requests(count: int) -> list[GenerationSpec]:
    return [GenerationSpec.create(
        request_id=new_request_id(), tenant=TENANT, prompt=f"p{i}", width=16, height=16,
        num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=i,
        output_format=OutputFormat.NPY) for i in range(count)]


def timed(settings: Settings, client: redis.Redis,
          target: Callable[[Stage, Settings, int], None],
          done: Callable[[], bool]) -> tuple[float, int]:
    """Seconds from go until ``done``, with one worker process per stage running ``target``;
    and the Redis commands run meanwhile, nested ones in scripts included."""
    procs = start_noop_workers(settings, BATCH, target)
    try:
        client.config_resetstat()
        start = time.perf_counter()
        client.set(NOOP_GO, 1)
        wait_until(done, timeout_s=600, interval_s=0.002, what="every job dispatched")
        elapsed = time.perf_counter() - start
        stats = client.info("commandstats")
    finally:
        stop_processes(procs)
    calls = sum(int(v["calls"]) for k, v in stats.items()
                if k not in ("cmdstat_config|resetstat", "cmdstat_info"))
    return elapsed, calls


def diffcache_round(settings: Settings, client: redis.Redis, count: int,
                    finished_before: int) -> tuple[float, int]:
    specs = requests(count)
    for spec in specs:  # acceptance (fsynced, one at a time) is not dispatch
        submit(client, spec)
    decode = StageQueue(client, Stage.DECODE, "bench")

    def done() -> bool:  # one round trip, as the raw baseline's check is
        read, in_flight = decode.progress()
        return read >= finished_before + count and not in_flight

    seconds, calls = timed(settings, client, run_noop, done)
    records = Records(client)
    assert all(r is not None and r.state is State.DONE
               for r in (records.get(TENANT, s.request_id) for s in specs))
    return seconds, calls


def raw_round(settings: Settings, client: redis.Redis, count: int) -> float:
    raw_dispatch.prepare(client, [request_record(TENANT, s.request_id)
                                  for s in requests(count)])
    seconds, _ = timed(settings, client, raw_dispatch.run_raw,
                       lambda: raw_dispatch.acknowledged(client) >= count)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dispatches = 3 * args.requests
    rows, ours, raw, calls = [], [], [], []
    with bench_stack(segment_mib=64) as settings:
        client = open_redis(settings)
        for r in range(args.rounds):
            # Alternate which goes first, so neither always runs on a warmer machine.
            order = ("diffcache", "raw") if r % 2 == 0 else ("raw", "diffcache")
            for kind in order:
                if kind == "diffcache":
                    seconds, n = diffcache_round(settings, client, args.requests,
                                                 r * args.requests)
                    ours.append(dispatches / seconds)
                    calls.append(n / dispatches)
                    rows.append([r, kind, dispatches, seconds, dispatches / seconds,
                                 n / dispatches])
                else:
                    seconds = raw_round(settings, client, args.requests)
                    raw.append(dispatches / seconds)
                    rows.append([r, kind, dispatches, seconds, dispatches / seconds, 4.0])
    per_s, raw_per_s = statistics.median(ours), statistics.median(raw)
    report("No-op dispatch through encode, denoise and decode streams, against raw Redis "
           "streams (medians over the rounds in the JSON line)",
           ["round", "path", "dispatches", "seconds", "per second", "redis calls each"],
           rows, {"bench": "dispatch", "per_s": round(per_s, 1),
                  "raw_per_s": round(raw_per_s, 1),
                  "ratio_to_raw": round(per_s / raw_per_s, 3),
                  "redis_calls_per_dispatch": round(statistics.median(calls), 2)})


if __name__ == "__main__":
    main()
