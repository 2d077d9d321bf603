"""Single-flight across processes: N callers in separate processes miss on one key at once.

Each process connects to the store, waits at a Redis barrier, then calls ``get_or_compute``
with a compute that takes a fixed time and counts itself in Redis. Without single-flight every
caller would compute; with it, one does.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import redis
import torch

from bench.common import bench_parser, bench_stack, report
from cachesvc.connect import open_cache
from config.settings import Settings
from keys import KeyKind, StoreKey

KEY = StoreKey("bench", KeyKind.EMBEDDING, "hot-negative-prompt")
COMPUTES = "bench:single_flight:computes"
READY = "bench:single_flight:ready"


def caller(settings: Settings, callers: int, compute_s: float,
           results: mp.Queue[tuple[str, float]]) -> None:
    cache = open_cache(settings)
    client = redis.Redis.from_url(settings.redis.url or "")

    def compute() -> torch.Tensor:
        client.incr(COMPUTES)
        time.sleep(compute_s)
        return torch.ones(4096)

    client.incr(READY)
    while int(client.get(READY) or 0) < callers:
        time.sleep(0.002)
    start = time.perf_counter()
    cached = cache.get_or_compute(KEY, compute)
    results.put((cached.outcome.value if cached.outcome else "degraded",
                 time.perf_counter() - start))
    cache.close()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--compute-s", type=float, default=1.0)
    args = parser.parse_args()
    with bench_stack(segment_mib=128) as settings:
        ctx = mp.get_context("spawn")
        results: mp.Queue[tuple[str, float]] = ctx.Queue()
        procs = [ctx.Process(target=caller,
                             args=(settings, args.callers, args.compute_s, results))
                 for _ in range(args.callers)]
        for p in procs:
            p.start()
        got = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        computes = int(redis.Redis.from_url(settings.redis.url or "").get(COMPUTES) or 0)
    outcomes = sorted({o for o, _ in got})
    rows = [[o, sum(1 for x, _ in got if x == o),
             max(t for x, t in got if x == o)] for o in outcomes]
    report(f"{args.callers} processes miss on one key", ["outcome", "callers", "max wait s"],
           rows, {"bench": "single_flight", "callers": args.callers, "computes": computes})


if __name__ == "__main__":
    main()
