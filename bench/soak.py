"""Redis stays bounded under sustained load: no-op jobs through the three streams with a short
retention and the retention sweep running every second, as the sweeper of ``diffcache up`` runs
it. Every job takes the full path (durable submit, fenced claims, publishes, acks).

Redis's ``used_memory`` is measured once the first tenth of the jobs (2,000 of 20,000) are done
and again once all of them are, each time after the retention has passed and a sweep has
removed what it keeps, so both measure what stays behind rather than what is in flight.
``memory_growth`` is end / first - 1: 0.05 means 5% more at the end. The goal is at most 0.10.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from bench.common import (
    NOOP_GO,
    bench_parser,
    bench_stack,
    report,
    start_noop_workers,
    stop_processes,
)
from cachesvc.redis_client import RedisClient, open_redis
from config.settings import RetentionSettings, Settings
from keys import GenerationSpec, OutputFormat, Priority
from keys.names import request_index, stage_stream
from workers.queue.messages import Stage
from workers.queue.metrics import stages as stage_metrics
from workers.queue.retention import Retention, RetentionError, SweepReport
from workers.queue.submit import new_request_id, submit

TENANT = "bench"
BATCH = 32  # workers.batch_size, as in bench.dispatch
SWEEP_EVERY_S = 1.0


class Sweeper:
    """Sweeps every ``SWEEP_EVERY_S`` on a thread, like ``diffcache up``; ``sweep`` also runs
    one on demand. One Retention for both, so tenants it has found stay found."""

    def __init__(self, settings: Settings, retention: RetentionSettings) -> None:
        self.client = open_redis(settings)
        self._retention = Retention(self.client, retention)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.totals = {"stream_entries": 0, "records": 0, "consumers": 0}
        self.peak_memory = 0
        self._thread = threading.Thread(target=self._run, name="sweeper", daemon=True)
        self._thread.start()

    def sweep(self) -> SweepReport:
        with self._lock:
            done = self._retention.sweep()
            self.totals["stream_entries"] += done.stream_entries
            self.totals["records"] += done.records
            self.totals["consumers"] += done.consumers
            return done

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_EVERY_S):
            try:
                self.sweep()
            except RetentionError as exc:
                print(f"sweep failed, retrying: {exc}", flush=True)
            self.peak_memory = max(self.peak_memory, used_memory(self.client))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def used_memory(client: RedisClient) -> int:
    return int(client.info("memory")["used_memory"])


def decoded(client: RedisClient) -> int:
    """Jobs the decode stage has published: the publish script counts each request once, and
    the count outlives the records that retention deletes."""
    return sum(stage_metrics.read(client, Stage.DECODE, p).count for p in Priority)


def run_jobs(client: RedisClient, specs: Sequence[GenerationSpec], done_before: int) -> None:
    """Submit ``specs`` one by one while the workers drain them, then wait until all are done."""
    for spec in specs:
        submit(client, spec)
    target = done_before + len(specs)
    deadline = time.monotonic() + 60 + len(specs) * 0.05
    while decoded(client) < target:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {decoded(client) - done_before} of {len(specs)} jobs were "
                             "done in time; see the worker output above")
        time.sleep(0.05)


def settle(client: RedisClient, sweeper: Sweeper, retain_s: float) -> dict[str, int]:
    """Wait out the retention, sweep until nothing is left to remove, and measure Redis."""
    time.sleep(retain_s + SWEEP_EVERY_S)
    deadline = time.monotonic() + 60
    while True:
        done = sweeper.sweep()
        left = int(client.zcard(request_index(TENANT)))
        if not (done.stream_entries or done.records or done.backlog or left):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{left} request records were still indexed a minute after "
                             "their retention")
        time.sleep(0.1)
    # Let the server's cron shrink the hash tables that the deletions emptied.
    time.sleep(1.0)
    entries = sum(int(client.xlen(stage_stream(s.value, p.value)))
                  for s in Stage for p in Priority)
    return {"used_memory": used_memory(client), "keys": int(client.dbsize()),
            "stream_entries": entries}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--first", type=int, default=None,
                        help="jobs before the first measurement (default: a tenth)")
    parser.add_argument("--retain-s", type=float, default=2.0,
                        help="retention of finished requests and dead letters")
    args = parser.parse_args()
    first = args.first or max(1, args.jobs // 10)
    if not 0 < first < args.jobs:
        parser.error("--first must be between 0 and --jobs")
    retention = RetentionSettings(finished_request_s=args.retain_s, dead_letter_s=args.retain_s)
    specs = [GenerationSpec.create(
        request_id=new_request_id(), tenant=TENANT, prompt=f"p{i}", width=16, height=16,
        num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=i,
        output_format=OutputFormat.NPY) for i in range(args.jobs)]
    with bench_stack(segment_mib=64) as settings:
        client = open_redis(settings)
        procs = start_noop_workers(settings, BATCH)
        client.set(NOOP_GO, 1)
        sweeper = Sweeper(settings, retention)
        try:
            start = time.perf_counter()
            run_jobs(client, specs[:first], 0)
            elapsed = time.perf_counter() - start
            after_first = settle(client, sweeper, args.retain_s)
            start = time.perf_counter()
            run_jobs(client, specs[first:], first)
            elapsed += time.perf_counter() - start
            end = settle(client, sweeper, args.retain_s)
        finally:
            sweeper.close()
            stop_processes(procs)
    growth = end["used_memory"] / after_first["used_memory"] - 1
    rows = [[f"after the first {first:,}", after_first["used_memory"], after_first["keys"],
             after_first["stream_entries"]],
            ["peak while running", sweeper.peak_memory, "", ""],
            [f"after all {args.jobs:,}", end["used_memory"], end["keys"],
             end["stream_entries"]]]
    report(f"Redis used_memory under {args.jobs:,} no-op jobs, retention {args.retain_s:g} s "
           f"(growth {growth:+.1%}, {args.jobs / elapsed:.0f} jobs/s)",
           ["measured", "used_memory (bytes)", "keys", "stream entries"], rows,
           {"bench": "soak", "jobs": args.jobs, "memory_growth": round(growth, 4),
            "first": first, "used_memory_after_first": after_first["used_memory"],
            "used_memory_end": end["used_memory"], "peak_used_memory": sweeper.peak_memory,
            "records_removed": sweeper.totals["records"],
            "stream_entries_trimmed": sweeper.totals["stream_entries"],
            "jobs_per_s": round(args.jobs / elapsed, 1)})


if __name__ == "__main__":
    main()
