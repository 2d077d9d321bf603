"""What cachesvc adds to Mooncake's raw zero-copy calls on the same data and buffers.

For each size, ``TensorCache.put_from``/``get_into`` (header, checksum, verification, counters)
is timed against the raw ``put_from``/``get_into`` on the same registered buffer, against the raw
session calls that the cache itself makes from 256 KiB up (start, one ranged transfer, end), and
the raw call against itself (a second, identical call: the noise floor of the method on this
machine). Each put follows a fresh write of its payload, as the zero-copy contract has it (fill
the slot, then put), the same untimed write for every variant. Calls are interleaved, and each
round takes the next of the 24 orders of the four variants, so every variant goes first, and
follows every other, equally often: what one call leaves in the caches weighs on them all
alike. Each ratio is one of medians.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from bench.common import bench_parser, bench_stack, median, report
from cachesvc.buffers import TensorSlot
from cachesvc.codec import TensorSpec
from cachesvc.connect import open_cache
from cachesvc.mooncake_store import replicate_config
from cachesvc.tensor_cache import TensorCache
from keys import KeyKind, StoreKey

SIZES_MIB = [0.0625, 0.25, 1, 4, 16, 64]
OPS = ("put", "get")
VARIANTS = ("raw", "raw_again", "session", "cache")
ORDERS = list(itertools.permutations(VARIANTS))
WARM_UP_ROUNDS = 4


def one_round(cache: TensorCache, slot: TensorSlot, payload: torch.Tensor, config: object,
              i: int, kind: KeyKind) -> dict[tuple[str, str], float]:
    """Seconds each call took, by (op, variant), on fresh keys; each put after ``payload`` is
    written into the slot."""
    buf, size, store = slot.buffer, slot.spec.entry_bytes, cache.store
    names = {v: f"v1:bench:scratch:{v}{i}" for v in ("raw", "raw_again", "session")}
    key = StoreKey("bench", kind, f"c{i}")

    def session_put() -> None:
        store.begin_put(names["session"], size, config)
        store.put_range(names["session"], buf.ptr, size, 0)
        store.end_put(names["session"])

    def session_get() -> None:
        store.begin_get(names["session"])
        store.get_range(names["session"], buf.ptr, size, 0)
        store.end_get(names["session"])

    calls: dict[tuple[str, str], Callable[[], object]] = {
        ("put", "raw"): lambda: store.put_from(names["raw"], buf.ptr, size, config),
        ("put", "raw_again"): lambda: store.put_from(names["raw_again"], buf.ptr, size, config),
        ("put", "session"): session_put,
        ("put", "cache"): lambda: cache.put_from(key, slot),
        ("get", "raw"): lambda: store.get_into(names["raw"], buf.ptr, buf.capacity),
        ("get", "raw_again"): lambda: store.get_into(names["raw_again"], buf.ptr, buf.capacity),
        ("get", "session"): session_get,
        ("get", "cache"): lambda: cache.get_into(key, slot),
    }
    times = {}
    for op in OPS:
        for variant in ORDERS[i % len(ORDERS)]:
            if op == "put":
                slot.tensor.copy_(payload)  # the producer's write
            start = time.perf_counter()
            calls[op, variant]()
            times[op, variant] = time.perf_counter() - start
    for name in names.values():
        store.remove(name)
    cache.remove(key)
    return times


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=2 * len(ORDERS),
                        help=f"timed runs per size; a multiple of {len(ORDERS)} balances orders")
    parser.add_argument("--kind", type=KeyKind, default=KeyKind.SCRATCH,
                        help="the cache's entries' kind: one the value index records "
                        "(e.g. output) times its record too")
    args = parser.parse_args()

    rows: list[list[object]] = []
    ratios: dict[str, list[float]] = {f"{op}_{name}": [] for name in (
        "ratio", "ratio_vs_session", "ratio_noise") for op in OPS}
    with bench_stack(segment_mib=1024) as settings:
        cache = open_cache(settings.model_copy(update={"store": settings.store.model_copy(
            update={"buffer_slab_mib": 80, "buffer_slabs": 1})}))
        config = replicate_config(soft_pin=False)
        for mib in SIZES_MIB:
            spec = TensorSpec("float32", (int(mib * (1 << 20)) // 4,))
            times: dict[tuple[str, str], list[float]] = {(op, v): [] for op in OPS
                                                         for v in VARIANTS}
            payload = torch.randn(spec.shape)
            with cache.slot(spec) as slot:
                slot.tensor.copy_(payload)
                cache.put_from(StoreKey("bench", KeyKind.SCRATCH, "seed"), slot)
                for i in range(args.repeats + WARM_UP_ROUNDS):
                    for name, dt in one_round(cache, slot, payload, config, i,
                                              args.kind).items():
                        if i >= WARM_UP_ROUNDS:
                            times[name].append(dt)
            med = {k: median(v) for k, v in times.items()}
            for op in OPS:
                raw, session, cached = med[op, "raw"], med[op, "session"], med[op, "cache"]
                ratios[f"{op}_ratio"].append(round(cached / raw, 4))
                ratios[f"{op}_ratio_vs_session"].append(round(cached / session, 4))
                ratios[f"{op}_ratio_noise"].append(round(med[op, "raw_again"] / raw, 4))
                rows.append([mib, op, raw * 1e3, session * 1e3, cached * 1e3,
                             *(ratios[f"{op}_{name}"][-1] for name in (
                                 "ratio", "ratio_vs_session", "ratio_noise"))])
        cache.close()
    from_1mib = [i for i, mib in enumerate(SIZES_MIB) if mib >= 1]
    worst = {f"worst_{op}_{name}_from_1mib": max(ratios[f"{op}_{name}"][i] for i in from_1mib)
             for name in ("ratio", "ratio_noise") for op in OPS}
    report("cachesvc over raw Mooncake (put_from/get_into), median ms; session: the calls the "
           "cache makes from 256 KiB up; raw/raw: a second identical raw call, the noise floor",
           ["MiB", "op", "raw", "session", "cache", "cache/raw", "cache/ses", "raw/raw"], rows,
           {"bench": "cache_overhead", "sizes_mib": SIZES_MIB, **ratios, **worst})


if __name__ == "__main__":
    main()
