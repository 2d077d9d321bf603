"""Throughput over machines: the same seeded requests on a head with one node, then on a head
with two nodes, each node a network namespace pinned to one core (``taskset``), as a machine.

Every node runs all three stages. Reports the throughput of two nodes over one, the bytes the
nodes sent over their network interfaces (store transfers between hosts, plus the small Redis
and API traffic), the embedding hit rate, and whether both runs gave identical outputs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.common import bench_parser, report
from bench.netns import NodeSpec, network, start_cluster, unavailable
from workers.families import preset_family

API_PORT = 8000
PROMPTS = ["a lighthouse in fog", "a red kite over a field", "a paper boat on a pond",
           "a lantern on a snowy street", "a fox in tall grass", "rain on a tin roof"]


def bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": "blurry", "seed": 1000 + i,
             "width": args.size, "height": args.size, "num_frames": args.frames,
             "num_inference_steps": args.steps, "guidance_scale": 5.0, "output_format": "npy"}
            for i in range(args.requests)]


def run(nodes: int, model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One cluster of ``nodes`` one-core nodes; the batch's wall time, traffic and hits."""
    names = [f"n{i + 1}" for i in range(nodes)]
    work.mkdir(parents=True)
    with network(["head", *names]) as hosts:
        driver = start_cluster(hosts, {n: NodeSpec(cpus=str(i % (os.cpu_count() or 1)),
                                                   segment_mib=256)
                                       for i, n in enumerate(names)},
                               model_dir, work, API_PORT, DIFFCACHE_WORKERS__PREEMPT="false")
        try:
            sent = sum(hosts[n].sent_bytes() for n in names)
            out = work / "outputs"
            out.mkdir()
            batch = driver.call("run_batch", bodies=bodies(args), out_dir=str(out))
            sent = sum(hosts[n].sent_bytes() for n in names) - sent
            records = [driver.call("fields", id=i) for i in batch["ids"]]
        finally:
            driver.close()
    lookups = sum(int(r.get("lookups:embed", 0)) for r in records)
    hits = sum(int(r.get("hits:embed", 0)) for r in records)
    return {"seconds": batch["seconds"], "sent_bytes": sent,
            "hit_rate": hits / lookups if lookups else 0.0,
            "outputs": [(out / f"{i}.npy").read_bytes() for i in range(args.requests)]}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="width and height")
    parser.add_argument("--frames", type=int, default=9)
    args = parser.parse_args()
    if (why := unavailable()) is not None:
        raise SystemExit(f"bench.cluster needs network namespaces: {why}")
    with tempfile.TemporaryDirectory(prefix="diffcache-cluster-") as tmp:
        model_dir = Path(tmp) / "model"
        preset_family("default").build(model_dir, "test", 0)
        one = run(1, model_dir, Path(tmp) / "one", args)
        two = run(2, model_dir, Path(tmp) / "two", args)
    result = {"bench": "cluster", "requests": args.requests, "nodes": [1, 2],
              "throughput_ratio": round(one["seconds"] / two["seconds"], 3),
              "cross_node_bytes": two["sent_bytes"],
              "embedding_hit_rate": round(two["hit_rate"], 3),
              "identical": one["outputs"] == two["outputs"]}
    report("The same requests on one node and on two (one core each)",
           ["nodes", "seconds", "req/s", "bytes sent by nodes", "embedding hit rate"],
           [[n, r["seconds"], args.requests / r["seconds"], r["sent_bytes"], r["hit_rate"]]
            for n, r in ((1, one), (2, two))], result)


if __name__ == "__main__":
    main()
