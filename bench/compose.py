"""Every speedup at once, on the default stack (the shipped shapes model, ``max_batch`` 8): six
phases of 48 requests each, every phase with fresh prompts and seeds, all submitted at once.

- ``exact``: no step cache, no adapter;
- ``first_block``, ``magcache``, ``taylorseer``: every request under that policy (its
  defaults);
- ``mixed``: a third each of exact, first-block and MagCache, half the requests carrying one
  of four LoRA adapters;
- ``adapters``: the ``exact`` phase's requests, each with one of four adapters in turn.

Per phase: requests per second (first submission to last output), the forwards the engine
ran and its rows per forward, and the forwards a step cache stood in for. Each ratio is a
phase's requests per second over ``exact``'s in the same run (``adapters_ratio`` over the
same requests without adapters), and a sample of every phase is compared bit for bit with
its pipeline under the same hook and adapters (CPU, float32, one thread per op).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import bench_parser, collect, model_stack, report, workers
from bench.lora import random_lora
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import GenerationSpec, LoraUse, OutputFormat, StepCache, StepCachePolicy, adapter_key
from training.scenes import scene_at
from workers.families import preset_family
from workers.families.base import CPU
from workers.queue.metrics.engine import read_rows
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id, submit
from workers.stages.adapters import adapter_name

TENANT = "compose"
SCENES = 900  # the dataset seed of the prompts: apart from the model's and the other benches'
POLICY = {name: StepCache.create(policy) for name, policy in [
    ("exact", StepCachePolicy.OFF), ("first_block", StepCachePolicy.FIRST_BLOCK),
    ("magcache", StepCachePolicy.MAGCACHE), ("taylorseer", StepCachePolicy.TAYLORSEER)]}


def adapters(settings: Settings, count: int) -> list[tuple[LoraUse, dict[str, torch.Tensor]]]:
    """``count`` random adapters of the shapes DiT's attention, uploaded as the API keeps
    them; each with its weights (for the reference)."""
    import xxhash
    from safetensors.torch import save as save_safetensors

    cache = open_cache(settings)
    made = []
    try:
        for n in range(count):
            state = random_lora(settings.model_dir, seed=100 + n,
                                targets=("attn.to_q", "attn.to_v"))
            data = save_safetensors(state)
            content_hash = xxhash.xxh3_128_hexdigest(data)
            cache.put(adapter_key(TENANT, content_hash),
                      torch.frombuffer(bytearray(data), dtype=torch.uint8))
            made.append((LoraUse(content_hash, 0.8), state))
    finally:
        cache.close()
    return made


def phase_specs(settings: Settings, phase: str, first: int, requests: int,
                loras: Sequence[LoraUse]) -> list[GenerationSpec]:
    """One phase's requests: fresh prompts and seeds from ``first`` on."""
    m = request_defaults(settings.model, settings.model_dir)
    specs = []
    for n in range(requests):
        if phase == "mixed":
            cache = list(POLICY.values())[n % 3]  # exact, first-block, MagCache in turn
            used = (loras[(n // 2) % len(loras)],) if n % 2 else ()
        else:
            cache = POLICY.get(phase, POLICY["exact"])
            used = (loras[n % len(loras)],) if phase == "adapters" else ()
        specs.append(GenerationSpec.create(
            request_id=new_request_id(), tenant=TENANT, prompt=scene_at(SCENES, first + n).caption,
            width=m.width, height=m.height, num_frames=1,
            num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
            seed=first + n, output_format=OutputFormat.NPY, step_cache=cache, loras=used))
    return specs


def run_phase(records: Records, cache: TensorCache, specs: list[GenerationSpec]
              ) -> tuple[float, list[RequestRecord], list[np.ndarray], int, int]:
    """All of ``specs`` at once: seconds, records, outputs, forwards and rows the engine
    ran for them."""
    before = read_rows(records.redis)
    start = time.perf_counter()
    for spec in specs:
        submit(records.redis, spec)
    done, frames = collect(records, cache, specs)
    seconds = time.perf_counter() - start
    after = read_rows(records.redis)
    forwards = {rows: after.get(rows, 0) - before.get(rows, 0) for rows in after}
    return (seconds, done, frames, sum(forwards.values()),
            sum(rows * n for rows, n in forwards.items()))


def identical(directory: Path, samples: list[tuple[GenerationSpec, np.ndarray]],
              weights: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Each sampled output against the pipeline with its hook and adapters (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pipes: dict[tuple[LoraUse, ...], Any] = {}
    try:
        for spec, frames in samples:
            if spec.loras not in pipes:
                pipe: Any = preset_family("shapes").reference(directory, CPU)
                for lora in spec.loras:
                    pipe.pipe.load_lora_weights(weights[lora.hash],
                                                adapter_name=adapter_name(lora.hash))
                    pipe.pipe.set_adapters([adapter_name(lora.hash)], [lora.scale])
                pipes[spec.loras] = pipe
            if not np.array_equal(frames, pipes[spec.loras](spec)):
                return False
        return True
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--sample", type=int, default=2, help="outputs per phase compared "
                        "with the pipeline")
    args = parser.parse_args()
    phases = ["exact", "first_block", "magcache", "taylorseer", "mixed", "adapters"]
    rows: list[list[object]] = []
    rps: dict[str, float] = {}
    samples: list[tuple[GenerationSpec, np.ndarray]] = []
    with model_stack(model={"preset": "shapes"}) as settings:
        records, cache = Records(open_redis(settings)), open_cache(settings)
        made = adapters(settings, 4)
        loras = [lora for lora, _ in made]
        with workers(settings, settings.data_dir / "logs"):
            exact: list[GenerationSpec] = []
            for k, phase in enumerate(phases):
                specs = phase_specs(settings, phase, 1000 * k, args.requests, loras)
                if phase == "adapters":  # the exact phase's very requests, adapted
                    specs = [dataclasses.replace(spec, request_id=new_request_id(),
                                                 loras=(loras[n % len(loras)],))
                             for n, spec in enumerate(exact)]
                exact = specs if phase == "exact" else exact
                seconds, done, frames, forwards, ran = run_phase(records, cache, specs)
                rps[phase] = len(specs) / seconds
                skipped = sum(r.counter("hits:step") for r in done)
                rows.append([phase, len(specs), round(rps[phase], 3), forwards,
                             round(ran / max(forwards, 1), 2), skipped])
                # One adapted and one not where the phase has both.
                picks = sorted(range(len(specs)), key=lambda n: (bool(specs[n].loras), n))
                samples += [(specs[n], frames[n]) for n in picks[:1] + picks[-1:]][:args.sample]
        cache.close()
        same = identical(settings.model_dir, samples, {lora.hash: w for lora, w in made})
    ratios = {f"{phase}_ratio": round(rps[phase] / rps["exact"], 3)
              for phase in phases if phase != "exact"}
    report(f"{args.requests} requests per phase on the shapes model (max_batch 8), "
           "submitted at once", ["phase", "requests", "requests/s", "forwards",
                                 "rows per forward", "forwards stood in for"], rows,
           {"bench": "compose", "first_block_ratio": ratios["first_block_ratio"],
            "magcache_ratio": ratios["magcache_ratio"],
            "taylorseer_ratio": ratios["taylorseer_ratio"], "mixed_ratio": ratios["mixed_ratio"],
            "adapters_ratio": ratios["adapters_ratio"], "identical": same})


if __name__ == "__main__":
    main()
