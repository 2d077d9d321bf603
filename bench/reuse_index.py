"""The approximate-reuse index at scale: lookups per second and their p99 with a million
registered requests in one bucket, and the same million spread over 10,000 buckets.

Vectors are registered through the index itself (durable in Valkey streams), then a fresh
index catches up from the streams, as a restarted worker does; that rebuild is timed too.
Queries are registered vectors with noise added (a similar prompt, not the same one); the
report gives how often the index returns the true nearest vector (an exact search over the
same bucket), since faiss' inverted-file index trades a little recall for speed.
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import bench_parser, bench_stack, report
from cachesvc.redis_client import open_redis
from cachesvc.reuse_index import ReuseIndex

TENANT = "bench"
REGISTER_BATCH = 5_000  # vectors per pipelined round trip while registering


def unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def register(index: ReuseIndex, buckets: list[str], vectors: np.ndarray) -> None:
    """Vector i into bucket i mod len(buckets), pipelined as a bulk load would be."""
    for start in range(0, len(vectors), REGISTER_BATCH):
        index.register_many([(TENANT, buckets[i % len(buckets)], f"r{i}", vectors[i])
                             for i in range(start, min(start + REGISTER_BATCH, len(vectors)))])


CHECKED = 200  # lookups whose answer is checked against an exact search, after the timing


def lookups(index: ReuseIndex, buckets: list[str], vectors: np.ndarray, queries: int,
            rng: np.random.Generator) -> tuple[list[float], float]:
    """Milliseconds per lookup, and the share of the first ``CHECKED`` whose first answer is
    the true nearest (checked after the timed loop, which it would otherwise disturb)."""
    times, answers = [], []
    picks = rng.integers(0, len(vectors), queries)
    noise = unit(rng, queries, vectors.shape[1])
    for i, extra in zip(picks, noise, strict=True):
        query = vectors[i] + 0.05 * extra
        query /= np.linalg.norm(query)
        start = time.perf_counter()
        near = index.nearest(TENANT, buckets[i % len(buckets)], query, 8)
        times.append((time.perf_counter() - start) * 1000)
        answers.append((i, query, near[0].request_id if near else None))
    found = 0
    for i, query, first in answers[:CHECKED]:
        members = np.arange(i % len(buckets), len(vectors), len(buckets))
        scores = vectors @ query if len(buckets) == 1 else vectors[members] @ query
        found += first == f"r{members[int(np.argmax(scores))]}"
    return times, found / min(CHECKED, queries)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256, help="floats per vector: 256, the "
                        "most a first-step vector keeps (prompt_view.MAX_FLOATS); the "
                        "README's first figures were measured at 64")
    parser.add_argument("--buckets", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=2_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    vectors = unit(rng, args.vectors, args.dim)
    rows, figures = [], {}
    with bench_stack(segment_mib=64) as settings:
        client = open_redis(settings)
        for label, count in (("one bucket", 1), (f"{args.buckets} buckets", args.buckets)):
            buckets = [f"{label.replace(' ', '-')}-{b}" for b in range(count)]
            start = time.perf_counter()
            register(ReuseIndex(client), buckets, vectors)
            registered_s = time.perf_counter() - start
            index = ReuseIndex(client)  # a restarted worker: rebuilt from the streams
            start = time.perf_counter()
            for bucket in buckets:
                index.nearest(TENANT, bucket, vectors[0], 1)
            rebuilt_s = time.perf_counter() - start
            times, recall = lookups(index, buckets, vectors, args.queries, rng)
            p50, p99 = np.percentile(times, [50, 99])
            per_s = 1000 / float(np.mean(times))
            rows.append([label, args.vectors, registered_s, rebuilt_s, per_s, p50, p99, recall])
            figures[count] = (float(p99), per_s)
            client.flushdb()
    report(f"approximate-reuse index, {args.vectors:,} vectors of {args.dim} floats; "
           "lookups of a registered vector with noise added, 8 neighbours each",
           ["layout", "vectors", "register s", "rebuild s", "lookups/s", "p50 ms", "p99 ms",
            "nearest found"], rows,
           {"bench": "reuse_index", "vectors": args.vectors,
            "p99_ms": round(figures[1][0], 3),
            "p99_ms_10k_buckets": round(figures[args.buckets][0], 3),
            "lookups_per_s": round(figures[1][1], 1)})


if __name__ == "__main__":
    main()
