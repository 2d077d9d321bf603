"""End to end: the monolithic diffusers pipeline against diffcache, one workload, one run.

(a) Baseline: one process calls ``WanPipeline`` on each request in turn and encodes the MP4.
(b) diffcache: the embedded stack with one worker per stage; every request is submitted through
the queue at once, and the run ends when the last one is DONE.
The workload draws prompts Zipf(1.1) over 200 prompts, 3 negative prompts and random seeds, at
the built-in model's default size and steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench.common import model_stack, report, seconds_to_done, wait_all, workers
from bench.workload import Draw, zipf_requests
from cachesvc.connect import open_redis
from cachesvc.settings import Settings
from keys import GenerationSpec, OutputFormat
from workers.families import wan
from workers.media import encode_frames
from workers.messages import Stage
from workers.records import Records
from workers.submit import new_request_id, submit


def spec_for(settings: Settings, draw: Draw) -> GenerationSpec:
    m = settings.model
    return GenerationSpec.create(
        request_id=new_request_id(), tenant="bench", prompt=draw.prompt,
        negative_prompt=draw.negative_prompt, width=m.width, height=m.height,
        num_frames=m.num_frames, num_inference_steps=m.num_inference_steps,
        guidance_scale=m.guidance_scale, seed=draw.seed, output_format=OutputFormat.MP4)


def run_baseline(settings: Settings, specs: list[GenerationSpec]) -> float:
    """Seconds for the monolithic pipeline to serve ``specs`` one after another."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(settings.model_dir)
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    for spec in specs:
        segment = spec.schedule[0]
        frames = pipe(segment.prompt, negative_prompt=segment.negative_prompt,
                      height=spec.height, width=spec.width, num_frames=spec.num_frames,
                      num_inference_steps=spec.num_inference_steps,
                      guidance_scale=spec.guidance_scale,
                      generator=torch.Generator().manual_seed(spec.seed),
                      output_type="np").frames[0]
        encode_frames([wan.to_uint8(frames)], OutputFormat.MP4, settings.workers.fps)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with model_stack() as settings:
        draws = zipf_requests(args.requests, seed=args.seed)
        baseline_s = run_baseline(settings, [spec_for(settings, d) for d in draws])
        client = open_redis(settings)
        records = Records(client)
        specs = [spec_for(settings, d) for d in draws]
        with workers(settings, settings.data_dir / "logs"):
            start = time.perf_counter()
            for spec in specs:
                submit(client, spec)
            done = wait_all(records, specs, poll_s=0.05)
            diffcache_s = time.perf_counter() - start

    finished = [done[s.request_id] for s in specs]
    latencies = [seconds_to_done(r) for r in finished]
    seconds = {stage.value: sum(r.stage_seconds().get(stage.value, 0.0) for r in finished)
               for stage in Stage}
    total = sum(seconds.values())
    share = {k: round(v / total, 3) for k, v in seconds.items()}
    hits = sum(r.hits().get("embed", 0) for r in finished)
    lookups = sum(int(r.fields.get("lookups:embed", 0)) for r in finished)
    result = {
        "bench": "e2e", "requests": args.requests,
        "baseline_rps": round(args.requests / baseline_s, 4),
        "diffcache_rps": round(args.requests / diffcache_s, 4),
        "ratio": round(baseline_s / diffcache_s, 4),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(float(np.percentile(latencies, 99)), 3),
        "stage_share": share,
        "embedding_hit_rate": round(hits / lookups, 4) if lookups else 0.0,
    }
    rows: list[list[object]] = [
        ["baseline (WanPipeline), total", baseline_s, args.requests / baseline_s],
        ["diffcache (3 stage workers), total", diffcache_s, args.requests / diffcache_s]]
    rows += [[f"diffcache {stage}, mean per request", s / len(finished), ""]
             for stage, s in seconds.items()]
    report(f"{args.requests} requests, monolithic pipeline vs diffcache",
           ["run", "seconds", "requests/s"], rows, result)


if __name__ == "__main__":
    main()
