"""End to end: a family's monolithic diffusers pipeline against diffcache, one workload.

(a) Baseline: one process calls the family's pipeline on each request in turn.
(b) diffcache: the embedded stack with one worker per stage; every request is submitted through
the queue at once, and the run ends when the last one is DONE.
Both write lossless ``.npy`` outputs, so every diffcache output is also compared with the
pipeline's output for the same request (run again with one thread per op, as the workers run:
the timed baseline keeps torch's default threads). The workload draws prompts Zipf(1.1) over
200 prompts, 3 negative prompts and random seeds, at the built-in model's default size and
steps (one frame for an image family).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from bench.common import bench_parser, model_stack, report, seconds_to_done, wait_all, workers
from bench.workload import Draw, zipf_requests
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from config.settings import Settings
from keys import GenerationSpec, ImageInput, OutputFormat, StoreKey, image_key
from uploads.images import InputImage, normalise
from workers.engine.timing import release_memory
from workers.families import DEFAULT_FAMILY, family_named
from workers.families.base import Family, Placement
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy, encode_frames


def placement_of(settings: Settings) -> Placement:
    """Where the workers put the model: the reference runs there too."""
    return Placement.for_settings(settings.model.device, settings.model.dtype)


TENANT = "bench"


def input_image(settings: Settings, family: Family) -> InputImage | None:
    """For a family every request of which takes an image (image-to-video, editing): one,
    uploaded as ``POST /v1/images`` keeps it; None for the others."""
    if not family.limits.image_conditions:
        return None
    blocks = np.random.default_rng(0).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(blocks).resize((96, 96), Image.Resampling.NEAREST).save(out, format="PNG")
    image = normalise(out.getvalue(), 2**20, 2**20)
    cache = open_cache(settings)
    try:
        cache.put(image_key(TENANT, image.hash), torch.frombuffer(bytearray(image.png),
                                                                  dtype=torch.uint8))
    finally:
        cache.close()
    return image


def spec_for(settings: Settings, family: Family, draw: Draw,
             image: InputImage | None = None) -> GenerationSpec:
    m = request_defaults(settings.model, settings.model_dir)
    return GenerationSpec.create(
        request_id=new_request_id(), tenant=TENANT, prompt=draw.prompt,
        negative_prompt=draw.negative_prompt, width=m.width, height=m.height,
        num_frames=m.num_frames if family.limits.video else 1,
        num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
        seed=draw.seed, output_format=OutputFormat.NPY,
        image=None if image is None else ImageInput(image.hash, strength=None))


def pipeline_of(settings: Settings, family: Family,
                image: InputImage | None) -> Callable[[GenerationSpec], np.ndarray]:
    """The family's pipeline, placed as the workers are, given the requests' image."""
    pipeline = family.reference(settings.model_dir, placement_of(settings))
    if image is None:
        return pipeline
    picture = Image.open(io.BytesIO(image.png))
    return lambda spec: pipeline(spec, picture)


def run_baseline(settings: Settings, family: Family, specs: list[GenerationSpec],
                 image: InputImage | None = None) -> float:
    """Seconds for the monolithic pipeline to serve ``specs`` one after another. Its weights
    leave the device after (``release_memory``): the workers measured next have it whole."""
    pipeline = pipeline_of(settings, family, image)
    start = time.perf_counter()
    for spec in specs:
        encode_frames([pipeline(spec)], OutputFormat.NPY, settings.workers.fps)
    seconds = time.perf_counter() - start
    del pipeline
    release_memory(placement_of(settings).device)
    return seconds


def all_identical(settings: Settings, family: Family, specs: list[GenerationSpec],
                  records: list[RequestRecord], image: InputImage | None = None) -> bool:
    """Whether every diffcache output equals the pipeline's, both with one thread per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pipeline = pipeline_of(settings, family, image)
    cache = open_cache(settings)
    try:
        for spec, record in zip(specs, records, strict=True):
            assert record.output_key is not None
            data = cache.get(StoreKey.parse(record.output_key), lookup=False)
            if data is None or not np.array_equal(decode_npy(data.numpy().tobytes()),
                                                  pipeline(spec)):
                return False
        return True
    finally:
        cache.close()
        torch.set_num_threads(threads)


def measure(family: Family, requests: int, seed: int,
            model: dict[str, object] | None = None) -> tuple[dict[str, object], list[list[object]]]:
    """One run of the comparison; ``model`` overrides the model settings (size, device)."""
    with model_stack(family=family.name, model=model) as settings:
        draws = zipf_requests(requests, seed=seed)
        image = input_image(settings, family)
        baseline_s = run_baseline(settings, family, [spec_for(settings, family, d, image)
                                                     for d in draws], image)
        client = open_redis(settings)
        specs = [spec_for(settings, family, d, image) for d in draws]
        with workers(settings, settings.data_dir / "logs"):
            start = time.perf_counter()
            for spec in specs:
                submit(client, spec)
            done = wait_all(Records(client), specs, poll_s=0.05)
            diffcache_s = time.perf_counter() - start
        finished = [done[s.request_id] for s in specs]
        identical = all_identical(settings, family, specs, finished, image)

    latencies = [seconds_to_done(r) for r in finished]
    seconds = {stage.value: sum(r.stage_seconds().get(stage, 0.0) for r in finished)
               for stage in Stage}
    total = sum(seconds.values())
    share = {k: round(v / total, 3) for k, v in seconds.items()}
    hits = sum(r.hits().get("embed", 0) for r in finished)
    lookups = sum(int(r.fields.get("lookups:embed", 0)) for r in finished)
    result: dict[str, object] = {
        "bench": "e2e", "family": family.name, "requests": requests,
        "baseline_rps": round(requests / baseline_s, 4),
        "diffcache_rps": round(requests / diffcache_s, 4),
        "ratio": round(baseline_s / diffcache_s, 4),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(float(np.percentile(latencies, 99)), 3),
        "stage_share": share,
        "embedding_hit_rate": round(hits / lookups, 4) if lookups else 0.0,
        "identical": identical,
    }
    rows: list[list[object]] = [
        [f"baseline ({family.pipeline_class}), total", baseline_s, requests / baseline_s],
        ["diffcache (3 stage workers), total", diffcache_s, requests / diffcache_s]]
    rows += [[f"diffcache {stage}, mean per request", s / len(finished), ""]
             for stage, s in seconds.items()]
    return result, rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default=DEFAULT_FAMILY,
                        help="a family's name (workers.families)")
    args = parser.parse_args()
    result, rows = measure(family_named(args.family), args.requests, args.seed)
    report(f"{args.requests} requests, monolithic pipeline vs diffcache",
           ["run", "seconds", "requests/s"], rows, result)


if __name__ == "__main__":
    main()
