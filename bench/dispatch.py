"""Dispatch rate of the queue contract: jobs per second through the three streams when the
stage bodies do nothing. Every dispatch still takes the full path (read, fenced claim, lease,
publish of the next job, state, latency and ack in one script) on Valkey with
``appendfsync always``, with workers batching up to ``BATCH`` jobs per round trip.

In the same run, on the same Valkey, rounds alternate with the raw Redis work a dispatch cannot
avoid (``bench.raw_dispatch``), so the ratio between the two holds on any disk and machine.
With ``--redis-cluster`` they alternate instead with the same dispatches on a Redis Cluster of
three masters with a replica each (``bench.valkey_cluster``), beside the single server.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from redis.cluster import RedisCluster

from bench import raw_dispatch
from bench.common import (
    NOOP_GO,
    bench_parser,
    bench_stack,
    report,
    run_noop,
    start_noop_workers,
    stop_processes,
)
from bench.valkey_cluster import LocalValkeyCluster
from cachesvc.redis_client import RedisClient, open_redis
from cachesvc.waiting import wait_until
from config.settings import RedisSettings, Settings
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


def timed(settings: Settings, client: RedisClient,
          target: Callable[[Stage, Settings, int], None],
          done: Callable[[], bool]) -> tuple[float, int]:
    """Seconds from go until ``done``, with one worker process per stage running ``target``;
    and the Redis commands run meanwhile (on every server), nested ones in scripts included."""
    procs = start_noop_workers(settings, BATCH, target)
    servers = ([client.get_redis_connection(n) for n in client.get_nodes()]
               if isinstance(client, RedisCluster) else [client])
    try:
        for server in servers:
            server.config_resetstat()
        start = time.perf_counter()
        client.set(NOOP_GO, 1)
        wait_until(done, timeout_s=600, interval_s=0.002, what="every job dispatched")
        elapsed = time.perf_counter() - start
        stats = [server.info("commandstats") for server in servers]
    finally:
        stop_processes(procs)
    calls = sum(int(v["calls"]) for server in stats for k, v in server.items()
                if k not in ("cmdstat_config|resetstat", "cmdstat_info"))
    return elapsed, calls


def diffcache_round(settings: Settings, client: RedisClient, count: int,
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


def raw_round(settings: Settings, client: RedisClient, count: int) -> float:
    raw_dispatch.prepare(client, [request_record(TENANT, s.request_id)
                                  for s in requests(count)])
    seconds, _ = timed(settings, client, raw_dispatch.run_raw,
                       lambda: raw_dispatch.acknowledged(client) >= count)
    return seconds


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis-cluster", action="store_true",
                        help="against a 3-master Redis Cluster instead of raw streams")
    args = parser.parse_args()
    if args.redis_cluster:
        on_cluster(args.requests, args.rounds)
    else:
        against_raw(args.requests, args.rounds)


def against_raw(count: int, rounds: int) -> None:
    dispatches = 3 * count
    rows, ours, raw, calls = [], [], [], []
    with bench_stack(segment_mib=64) as settings:
        client = open_redis(settings)
        for r in range(rounds):
            # Alternate which goes first, so neither always runs on a warmer machine.
            order = ("diffcache", "raw") if r % 2 == 0 else ("raw", "diffcache")
            for kind in order:
                if kind == "diffcache":
                    seconds, n = diffcache_round(settings, client, count, r * count)
                    ours.append(dispatches / seconds)
                    calls.append(n / dispatches)
                    rows.append([r, kind, dispatches, seconds, dispatches / seconds,
                                 n / dispatches])
                else:
                    seconds = raw_round(settings, client, count)
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



def on_cluster(count: int, rounds: int) -> None:
    """The same dispatches on one server and on a 3-master cluster, rounds alternating."""
    dispatches = 3 * count
    rows: list[list[object]] = []
    rates: dict[str, list[float]] = {"single": [], "cluster": []}
    with bench_stack(segment_mib=64) as single, \
            tempfile.TemporaryDirectory(prefix="diffcache-cluster-") as data, \
            LocalValkeyCluster(Path(data)) as cluster:
        clustered = single.model_copy(update={
            "redis": RedisSettings(url=cluster.url, cluster=True)})
        setups = {"single": (single, open_redis(single)),
                  "cluster": (clustered, open_redis(clustered))}
        for r in range(rounds):
            for kind in ("single", "cluster") if r % 2 == 0 else ("cluster", "single"):
                settings, client = setups[kind]
                seconds, n = diffcache_round(settings, client, count, r * count)
                rates[kind].append(dispatches / seconds)
                rows.append([r, kind, dispatches, seconds, dispatches / seconds,
                             n / dispatches])
    per_s, single_per_s = statistics.median(rates["cluster"]), statistics.median(rates["single"])
    report("No-op dispatch through encode, denoise and decode streams on a Redis Cluster of "
           "3 masters (a replica each) and on one server (medians in the JSON line)",
           ["round", "redis", "dispatches", "seconds", "per second", "redis calls each"],
           rows, {"bench": "dispatch", "cluster": True, "dispatches_per_s": round(per_s, 1),
                  "single_per_s": round(single_per_s, 1),
                  "ratio_to_single": round(per_s / single_per_s, 3)})


if __name__ == "__main__":
    main()
