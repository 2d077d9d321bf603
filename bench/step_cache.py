"""Step caching on the trained shapes model: each policy at its default setting against the
exact run, on the same held-out captions and seeds.

Per policy: the share of forwards a hook stood in for (part of), the change in attribute
accuracy read by the shipped classifier, the denoise speedup (the denoise stage's seconds of
all requests, exact over policy, with the default denoise workers each running one request
at a time unless ``--max-batch`` says more: what each request's denoising took, which grows
with the runs an engine holds at once), the throughput speedup (the seconds to serve every
request, all submitted at once, exact over policy), the size of a checkpoint against the exact run's
at the same step, whether a sample of outputs equals the shapes model's pipeline with the same hook
enabled, and whether each of them, resumed from a checkpoint half-way, gives the same output
again.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import bench_parser, model_stack, report, serve, workers
from bench.quality import HELD_OUT, READ, accuracy, specs_for
from cachesvc.connect import open_cache
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings, WorkerSettings
from keys import CfgCache, StepCache, StepCachePolicy, StoreKey
from training.classifier import load_classifier
from training.scenes import scene_at
from workers.families import preset_family
from workers.families.base import CPU
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.submit import new_request_id

POLICIES = [StepCachePolicy.FIRST_BLOCK, StepCachePolicy.TAYLORSEER, StepCachePolicy.MAGCACHE]


def checkpoint_bytes(cache: TensorCache, record: RequestRecord, step: int) -> int:
    data = cache.get(StoreKey.parse(record.checkpoints()[step]), lookup=False)
    assert data is not None, f"checkpoint {step} of {record.spec.request_id} is gone"
    return data.numel()


def resumed_equal(settings: Settings, records: Records, cache: TensorCache,
                  record: RequestRecord, frames: np.ndarray) -> bool:
    """The request again (a new id, the same trajectory), its later checkpoints and output
    lost, so it resumes half-way: the same frames?"""
    half = record.spec.num_inference_steps // 2
    for step, key in record.checkpoints().items():
        if step > half:
            cache.remove(StoreKey.parse(key))
    assert record.output_key is not None
    output = StoreKey.parse(record.output_key)
    cache.remove(output)
    OutputFiles(settings.outputs_dir, settings.cache.output_ttl_s).path(output).unlink(
        missing_ok=True)
    again = dataclasses.replace(record.spec, request_id=new_request_id())
    [rerun], [out] = serve(records, cache, [again])
    return rerun.counter("resumed_from") == half and np.array_equal(out, frames)


def denoise_seconds(records: list[RequestRecord]) -> float:
    return sum(r.stage_seconds()[Stage.DENOISE] for r in records)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--sample", type=int, default=3,
                        help="outputs per policy checked against the pipeline and on resume")
    parser.add_argument("--max-batch", type=int, default=1)
    args = parser.parse_args()
    # The pipeline runs here, in this process: one thread per op, as the workers run, which
    # is the condition bit-identity holds under (TaylorSeer's forecasts differ at two).
    torch.set_num_threads(1)
    classifier = load_classifier()
    scenes = [scene_at(HELD_OUT, i) for i in range(args.requests)]
    caches = {"exact": StepCache()} | {p.value: StepCache.create(p) for p in POLICIES}
    runs: dict[str, tuple[list[RequestRecord], np.ndarray]] = {}
    checks: dict[str, tuple[bool, bool]] = {}
    sizes: dict[str, int] = {}  # bytes of the first request's checkpoint half-way
    walls: dict[str, float] = {}  # seconds to serve each run's requests
    with model_stack(model={"preset": "shapes"}) as base:
        # At max_batch 1 each request runs alone: no other rides along while its cache skips.
        workers_settings = WorkerSettings(max_batch=args.max_batch, ride_along=1) \
            if args.max_batch == 1 else WorkerSettings(max_batch=args.max_batch)
        settings = base.model_copy(update={"workers": workers_settings})
        records = Records(open_redis(settings))
        cache = open_cache(settings)
        pipe = preset_family("shapes").reference(settings.model_dir, CPU)
        with tempfile.TemporaryDirectory() as logs, workers(settings, Path(logs)):
            for name, step_cache in caches.items():
                specs = [dataclasses.replace(s, step_cache=step_cache)
                         for s in specs_for(settings, name, scenes, CfgCache(), 1000)]
                start = time.perf_counter()
                served, outputs = serve(records, cache, specs)
                walls[name] = time.perf_counter() - start
                runs[name] = served, np.concatenate(outputs)
                first = runs[name][0][0]
                sizes[name] = checkpoint_bytes(cache, first, first.spec.num_inference_steps // 2)
            for name in caches:
                done, frames = runs[name]
                sample = range(min(args.sample, len(done)))
                checks[name] = (
                    all(np.array_equal(pipe(done[i].spec), frames[i:i + 1]) for i in sample),
                    all(resumed_equal(settings, records, cache, done[i], frames[i:i + 1])
                        for i in sample))
        cache.close()
    exact_records, exact_frames = runs["exact"]
    exact_acc = accuracy(classifier, exact_frames, scenes)
    exact_s = denoise_seconds(exact_records)
    rows: list[list[object]] = [["exact", *(exact_acc[a] for a in READ), "", round(exact_s, 2),
                                 "", "", "", *checks["exact"]]]
    results = []
    for policy in POLICIES:
        done, frames = runs[policy.value]
        acc = accuracy(classifier, frames, scenes)
        forwards = sum(r.counter("lookups:step") for r in done)
        skipped = sum(r.counter("hits:step") for r in done)
        entry = {"policy": policy.value, "params": dict(caches[policy.value].params),
                 "forwards_saved": round(skipped / forwards, 4),
                 "acc_delta": round(float(np.mean([acc[a] - exact_acc[a] for a in READ])), 4),
                 "denoise_speedup": round(exact_s / denoise_seconds(done), 3),
                 "throughput_speedup": round(walls["exact"] / walls[policy.value], 3),
                 "checkpoint_bytes_ratio": round(sizes[policy.value] / sizes["exact"], 3),
                 "identical_to_pipeline": checks[policy.value][0],
                 "identical_after_resume": checks[policy.value][1]}
        results.append(entry)
        rows.append([f"{policy.value} {entry['params']}", *(acc[a] for a in READ),
                     entry["forwards_saved"], round(denoise_seconds(done), 2),
                     entry["denoise_speedup"], entry["throughput_speedup"],
                     entry["checkpoint_bytes_ratio"],
                     *checks[policy.value]])
    report(f"step caches on the shapes model: {args.requests} held-out captions, one seed "
           f"each, max_batch {args.max_batch}; accuracy read by the classifier",
           ["run", *READ, "forwards saved", "denoise s", "speedup", "throughput",
            "ckpt bytes ratio",
            "= pipeline", "= after resume"], rows,
           {"bench": "step_cache", "requests": args.requests, "max_batch": args.max_batch,
            "policies": results})


if __name__ == "__main__":
    main()
