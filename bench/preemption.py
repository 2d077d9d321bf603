"""Preemption: interactive latency under a saturating batch load, with preemption on and off.

One worker per stage. Every batch request (long: many steps) is queued at the start, so the
denoise worker always has batch work; interactive requests (short) arrive at a fixed interval.
The same workload runs twice in one run, with ``workers.preempt`` off and then on, each phase
in its own tenant so that neither reuses the other's checkpoints or outputs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import bench_parser, model_stack, report, seconds_to_done, wait_all, workers
from bench.workload import prompt_pool
from cachesvc.redis_client import open_redis
from config.settings import Settings
from keys import GenerationSpec, OutputFormat, Priority
from workers.queue.records import Records
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id, submit


def make(settings: Settings, tenant: str, prompt: str, seed: int, steps: int,
         priority: Priority) -> GenerationSpec:
    m = request_defaults(settings.model, settings.model_dir)
    return GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=prompt, negative_prompt="blurry",
        width=m.width, height=m.height, num_frames=m.num_frames, num_inference_steps=steps,
        guidance_scale=m.guidance_scale, seed=seed, output_format=OutputFormat.MP4,
        priority=priority)


def phase(settings: Settings, preempt: bool, args: argparse.Namespace) -> dict[str, float]:
    tenant = "on" if preempt else "off"
    phase_settings = settings.model_copy(update={"workers": settings.workers.model_copy(
        update={"preempt": preempt})})
    prompts = prompt_pool(args.batch + args.interactive, seed=7)
    batch = [make(settings, tenant, prompts[i], 1000 + i, args.batch_steps, Priority.BATCH)
             for i in range(args.batch)]
    interactive = [make(settings, tenant, prompts[args.batch + i], 2000 + i,
                        args.interactive_steps, Priority.INTERACTIVE)
                   for i in range(args.interactive)]
    client = open_redis(settings)
    records = Records(client)
    with workers(phase_settings, settings.data_dir / "logs" / tenant):
        start = time.perf_counter()
        for spec in batch:
            submit(client, spec)
        time.sleep(args.every_s)
        for spec in interactive:
            submit(client, spec)
            time.sleep(args.every_s)
        done = wait_all(records, batch + interactive)
    batch_end = max(done[s.request_id].updated_at for s in batch)
    batch_start = min(done[s.request_id].created_at for s in batch)
    latencies = [seconds_to_done(done[s.request_id]) for s in interactive]
    return {
        "interactive_p50_s": float(np.percentile(latencies, 50)),
        "interactive_p99_s": float(np.percentile(latencies, 99)),
        "batch_per_min": 60 * len(batch) / (batch_end - batch_start),
        "preemptions": sum(done[s.request_id].counter("preemptions") for s in batch),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8, help="batch requests, queued at once")
    parser.add_argument("--batch-steps", type=int, default=100)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--interactive-steps", type=int, default=10)
    parser.add_argument("--every-s", type=float, default=3.0,
                        help="seconds between interactive arrivals")
    args = parser.parse_args()
    with model_stack() as settings:
        off = phase(settings, False, args)
        on = phase(settings, True, args)
    ratio = on["interactive_p99_s"] / off["interactive_p99_s"]
    throughput = on["batch_per_min"] / off["batch_per_min"]
    columns = ["preemption", "interactive p50 s", "interactive p99 s", "batch jobs/min",
               "preemptions", "phase s"]
    rows = [[name, r["interactive_p50_s"], r["interactive_p99_s"], r["batch_per_min"],
             int(r["preemptions"]), r["seconds"]] for name, r in (("off", off), ("on", on))]
    report(f"{args.batch} batch x {args.batch_steps} steps, {args.interactive} interactive x "
           f"{args.interactive_steps} steps every {args.every_s} s, one worker per stage",
           columns, rows,
           {"bench": "preemption", "interactive_p99_on_s": round(on["interactive_p99_s"], 3),
            "interactive_p99_off_s": round(off["interactive_p99_s"], 3),
            "ratio": round(ratio, 4), "batch_throughput_ratio": round(throughput, 4)})


if __name__ == "__main__":
    main()
