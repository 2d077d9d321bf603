"""What cachesvc adds to Mooncake's raw zero-copy calls on the same data and buffers.

For each size, the raw ``put_from``/``get_into`` on a registered buffer is timed against
``TensorCache.put_from``/``get_into`` (header, checksum, verification, counters) on the same
buffer, interleaved so that drift in the machine hits both alike. Ratios are medians.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import bench_stack, median, report
from cachesvc.codec import TensorSpec
from cachesvc.connect import open_cache
from cachesvc.mooncake_store import replicate_config
from cachesvc.tensor_cache import TensorCache, TensorSlot
from keys import KeyKind, StoreKey

SIZES_MIB = [0.0625, 0.25, 1, 4, 16, 64]


def one_round(cache: TensorCache, slot: TensorSlot, config: object, i: int) -> dict[str, float]:
    """Seconds each of the four calls took on one fresh pair of keys."""
    buf, size = slot.buffer, slot.spec.entry_bytes
    raw_key, key = f"v1:bench:scratch:raw{i}", StoreKey("bench", KeyKind.SCRATCH, f"c{i}")

    def run(name: str) -> float:
        start = time.perf_counter()
        if name == "raw_put":
            cache.store.put_from(raw_key, buf.ptr, size, config)
        elif name == "put":
            cache.put_from(key, slot)
        elif name == "raw_get":
            cache.store.get_into(raw_key, buf.ptr, buf.capacity)
        else:
            cache.get_into(key, buf)
        return time.perf_counter() - start

    times = {}
    # Alternate which side goes first, so ordering effects hit both alike.
    for pair in (("raw_put", "put"), ("raw_get", "get")):
        for name in pair if i % 2 else pair[::-1]:
            times[name] = run(name)
    cache.store.remove(raw_key)
    cache.remove(key)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per size (>= 7)")
    args = parser.parse_args()

    rows, put_ratios, get_ratios = [], [], []
    with bench_stack(segment_mib=1024) as settings:
        cache = open_cache(settings.model_copy(update={"store": settings.store.model_copy(
            update={"buffer_slab_mib": 80, "buffer_slabs": 1})}))
        config = replicate_config(soft_pin=False)
        for mib in SIZES_MIB:
            spec = TensorSpec("float32", (int(mib * (1 << 20)) // 4,))
            times: dict[str, list[float]] = {"raw_put": [], "put": [], "raw_get": [], "get": []}
            with cache.slot(spec) as slot:
                slot.tensor.copy_(torch.randn(spec.shape))
                cache.put_from(StoreKey("bench", KeyKind.SCRATCH, "seed"), slot)
                for i in range(args.repeats + 2):  # the first two rounds warm up
                    for name, dt in one_round(cache, slot, config, i).items():
                        if i >= 2:
                            times[name].append(dt)
            med = {k: median(v) for k, v in times.items()}
            put_ratios.append(round(med["put"] / med["raw_put"], 4))
            get_ratios.append(round(med["get"] / med["raw_get"], 4))
            rows.append([mib, med["raw_put"] * 1e3, med["put"] * 1e3, put_ratios[-1],
                         med["raw_get"] * 1e3, med["get"] * 1e3, get_ratios[-1]])
        cache.close()
    report("cachesvc overhead over raw Mooncake (median ms)",
           ["MiB", "raw put", "put", "put ratio", "raw get", "get", "get ratio"], rows,
           {"bench": "cache_overhead", "sizes_mib": SIZES_MIB, "put_ratio": put_ratios,
            "get_ratio": get_ratios})


if __name__ == "__main__":
    main()
