"""GPU: each family's three workers against its monolithic pipeline on CUDA, at a realistic size
for the tiny models (bfloat16 DiT and text encoder, on both sides, each module in the dtype its
pipeline keeps it in), and a device tensor's round trip through the store. The pipeline's
weights leave the device before the workers start (``bench.e2e``). Without CUDA it prints one
line saying so and ``{"bench": "gpu", "cuda": false}``. ``bench.gpu_check`` is the part that
needs neither the store nor Redis, for a lent machine that has neither.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.common import bench_parser, bench_stack, report
from bench.e2e import measure
from cachesvc.connect import open_cache
from keys import KeyKind, StoreKey
from workers.families import BUILT_IN

# Sizes where the tiny models do real work on a GPU: a 17-frame 256x256 video, a 512x512 image.
VIDEO = {"width": 256, "height": 256, "num_frames": 17, "num_inference_steps": 30}
IMAGE = {"width": 512, "height": 512, "num_inference_steps": 30}
ROUND_TRIPS = 5


def store_round_trip(mib: int) -> dict[str, float | bool]:
    """Put a CUDA tensor in the store and read it back onto the device: the median of
    ``ROUND_TRIPS`` after one untimed, each a put and a get through a registered buffer (a
    slab as large as the tensor, so no trip takes the oversize path, which registers memory
    per call and would time that instead)."""
    with bench_stack(segment_mib=4 * mib, store={"buffer_slab_mib": mib + 1}) as settings:
        cache = open_cache(settings)
        try:
            tensor = torch.randn(mib << 18, device="cuda")  # float32: 4 bytes each
            key = StoreKey("bench", KeyKind.SCRATCH, "gpu-round-trip")
            seconds, back = [], tensor
            for trip in range(ROUND_TRIPS + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                cache.put(key, tensor)
                read = cache.get(key, lookup=False)
                assert read is not None
                back = read.to("cuda")
                torch.cuda.synchronize()
                if trip:
                    seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds)
            return {"mib": mib, "seconds": round(median, 4),
                    "gb_per_s": round(2 * (mib / 1024) / median, 3),
                    "equal": bool(torch.equal(tensor, back))}
        finally:
            cache.close()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        print(json.dumps({"bench": "gpu", "cuda": False}), flush=True)
        return
    families = {}
    rows: list[list[object]] = []
    for family in BUILT_IN:
        name = family.name
        size = VIDEO if family.limits.video else IMAGE
        result, _ = measure(family, args.requests, args.seed, {**size, "device": "cuda"})
        families[name] = {k: result[k] for k in ("ratio", "identical", "stage_share",
                                                  "baseline_rps", "diffcache_rps")}
        rows.append([name, result["baseline_rps"], result["diffcache_rps"], result["ratio"],
                     result["identical"]])
    trip = store_round_trip(256)
    rows.append(["store round trip, 256 MiB (GB/s)", trip["gb_per_s"], "", "", trip["equal"]])
    report(f"CUDA ({torch.cuda.get_device_name()}): {args.requests} requests per family",
           ["family", "baseline req/s", "diffcache req/s", "ratio", "identical"], rows,
           {"bench": "gpu", "cuda": True, "device": torch.cuda.get_device_name(),
            "families": families, "store_round_trip": trip})


if __name__ == "__main__":
    main()
