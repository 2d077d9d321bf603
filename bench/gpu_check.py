"""The device check: what a lent GPU must show, in one process, with neither the store nor Redis
(the lent machine has neither, and takes 64 MiB of tree and wheels a call).

Per family: one request's frames through the workers' own components (text and image
encoders, the denoise engine's batched forwards, the decoder) against its diffusers pipeline
placed the same way (identical or not, and by how much); the row proof's verdict at each batch
size the warm-up forms; the engine's throughput at ``max_batch`` 1 and 8; and a first-block
step cache's speedup. Timings wait for the device (CUDA events on a GPU). The figures go to
``--out`` as JSON and, as every bench's, to stdout as a final JSON line.

    python -m bench.gpu_check --device cuda --models MODELS --out "$OUT"   # on the GPU
    python -m bench.gpu_check --device cpu --smoke                         # anywhere

``scripts/gpu_check.sh`` prepares the model folders and wheels here and runs it there.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import bench_parser, report
from encoders.text import ImageTextModel
from keys import GenerationSpec, ImageInput, OutputFormat, StepCache, StepCachePolicy
from workers.engine.core import DenoiseEngine
from workers.engine.guidance import Row
from workers.engine.row_caches import RunStepCache
from workers.engine.timing import release_memory
from workers.families import FAMILIES, family_named
from workers.families.base import Denoiser, Family, Placement

SMOKE = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3}
# Where the tiny models do real work on a GPU: a 17-frame 256x256 video, a 512x512 image.
FULL = {"width": 256, "height": 256, "num_frames": 17, "num_inference_steps": 20}
REQUESTS = 8  # per throughput run: one full engine at max_batch 8
PROMPTS = ["a red fox in the snow", "a small boat on a wide grey sea", "a cat on a sofa",
           "an old stone bridge at dusk", "a field of sunflowers", "a lighthouse in a storm",
           "a bowl of ripe cherries", "a city street in the rain"]


class Clock:
    """Seconds of device work: CUDA events on a GPU (no host stall inside the span), the
    wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, work: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            work()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000


@dataclasses.dataclass
class Trajectory:
    """One request denoised in this process: its rows each step, guided as its pipeline
    guides them (the workers' ``DenoiseRun`` without the queue and the store)."""

    spec: GenerationSpec
    cond: torch.Tensor
    uncond: torch.Tensor
    latents: torch.Tensor
    scheduler: Any
    condition: torch.Tensor | None
    cache: RunStepCache | None
    step: int = 0

    @property
    def finished(self) -> bool:
        return self.step >= self.spec.num_inference_steps

    def rows(self) -> list[Row]:
        t = self.scheduler.timesteps[self.step]
        rows = [Row(self.latents, t, embeds, self.spec, condition=self.condition)
                for embeds in (self.cond, self.uncond)]
        return rows if self.cache is None else self.cache.attach(rows)

    def advance(self, model: Denoiser, rows: Sequence[Row], outputs: Sequence[torch.Tensor]
                ) -> None:
        if self.cache is not None:
            self.cache.commit(rows)
        guided = model.guide(outputs[0], outputs[1], self.spec.guidance_scale)
        t = self.scheduler.timesteps[self.step]
        self.latents = self.scheduler.step(guided, t, self.latents, return_dict=False)[0]
        self.step += 1


class Components:
    """A family's workers' components, loaded once, on one placement."""

    def __init__(self, family: Family, directory: Path, placement: Placement) -> None:
        self.family = family
        self.text = family.text_encoder(directory, placement)
        self.model = family.denoiser(directory, placement)
        self.decoder = family.decoder(directory, placement)
        self.images = (None if family.image_encoder is None
                       else family.image_encoder(directory, placement))

    def trajectory(self, spec: GenerationSpec, image: Image.Image | None) -> Trajectory:
        def embed(text: str) -> torch.Tensor:
            if isinstance(self.text, ImageTextModel):
                assert image is not None
                return self.text.encode_with_image(text, image)
            return self.text.encode(self.text.tokenize(text))

        encoded = None
        if self.images is not None and image is not None:
            encoded = self.images.encode(image, spec.width, spec.height, spec.num_frames)
        takes = self.model.condition_shape(spec) is not None
        latents, _ = self.model.initial_latents(spec, encoded)
        cache = (RunStepCache(spec.step_cache, spec.num_inference_steps)
                 if spec.step_cache.on else None)
        segment = spec.schedule[0]
        return Trajectory(spec, embed(segment.prompt), embed(segment.negative_prompt), latents,
                          self.model.scheduler(spec), encoded if takes else None, cache)

    def frames(self, trajectory: Trajectory) -> np.ndarray:
        return np.concatenate(list(self.decoder.frames(trajectory.latents, trajectory.spec)))


def denoise(engine: DenoiseEngine, runs: list[Trajectory], max_batch: int) -> int:
    """Every run to its last step, at most ``max_batch`` stepped together (a finished run's
    place taken by the next, as the worker's loop does); the forwards run."""
    waiting, forwards = list(runs), 0
    active: list[Trajectory] = []
    while waiting or active:
        while waiting and len(active) < max_batch:
            active.append(waiting.pop(0))
        planned = {i: run.rows() for i, run in enumerate(active)}
        computed = engine.compute({(i, j): row for i, rows in planned.items()
                                   for j, row in enumerate(rows)})
        forwards += len(computed.forwards)
        for i, run in enumerate(active):
            run.advance(engine.model, planned[i],
                        [computed.outputs[i, j] for j in range(len(planned[i]))])
        active = [run for run in active if not run.finished]
    return forwards


def spec_for(family: Family, size: dict[str, int], n: int,
             step_cache: StepCache | None = None) -> GenerationSpec:
    return GenerationSpec.create(
        request_id=f"check-{n}", tenant="check", prompt=PROMPTS[n % len(PROMPTS)],
        negative_prompt="blurry", width=size["width"], height=size["height"],
        num_frames=size["num_frames"] if family.limits.video else 1,
        num_inference_steps=size["num_inference_steps"], guidance_scale=4.0, seed=n,
        output_format=OutputFormat.NPY, step_cache=step_cache or StepCache(),
        image=ImageInput("0" * 32, strength=None) if family.limits.image_conditions else None)


def picture(side: int) -> Image.Image:
    blocks = np.random.default_rng(0).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize((side, side), Image.Resampling.NEAREST)


def check_family(family: Family, directory: Path, placement: Placement,
                 size: dict[str, int], warm_up_s: float) -> dict[str, object]:
    """One family's figures (see the module's docstring)."""
    clock = Clock(placement.device)
    image = picture(size["width"]) if family.limits.image_conditions else None
    parts = Components(family, directory, placement)
    engine = DenoiseEngine(parts.model, 8, 1 << 20, adapters=4, parallel=False)
    proven = engine.warm_up(spec_for(family, size, 0), warm_up_s)
    refused = sorted(n for _, n in engine.executor.proof.refused)

    one = parts.trajectory(spec_for(family, size, 0), image)
    denoise(engine, [one], 1)
    ours = parts.frames(one)
    pipe = family.reference(directory, placement)
    theirs = pipe(one.spec, image) if image is not None else pipe(one.spec)
    del pipe  # its weights off the device before the timed runs
    release_memory(placement.device)
    apart = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))

    def run(max_batch: int, step_cache: StepCache | None = None) -> tuple[float, int]:
        runs = [parts.trajectory(spec_for(family, size, n, step_cache), image)
                for n in range(REQUESTS)]
        counted = [0]

        def work() -> None:
            counted[0] = denoise(engine, runs, max_batch)

        seconds = clock.time(work)
        return seconds, counted[0]

    alone_s, alone_forwards = run(1)
    batched_s, batched_forwards = run(8)
    cached_s, cached_forwards = run(1, StepCache.create(StepCachePolicy.FIRST_BLOCK))
    return {
        "identical": bool(apart.max() == 0), "max_abs_diff": int(apart.max()),
        "values_differing": round(float((apart > 0).mean()), 6),
        "proven_batch_sizes": proven, "refused_batch_sizes": refused,
        "rps_max_batch_1": round(REQUESTS / alone_s, 3),
        "rps_max_batch_8": round(REQUESTS / batched_s, 3),
        "batching_ratio": round(alone_s / batched_s, 3),
        "rows_per_forward_8": round(2 * REQUESTS * size["num_inference_steps"]
                                    / batched_forwards, 2),
        "first_block_ratio": round(alone_s / cached_s, 3),
        "forwards": {"alone": alone_forwards, "batched": batched_forwards,
                     "first_block": cached_forwards}}


def prepare(folder: Path, preset: str) -> None:
    """Each family's built-in model of ``preset`` under ``folder``: built here, where its
    tokenizer's word list is installed, and carried to a machine that has none."""
    for name in FAMILIES:
        family_named(name).build(folder / name, preset, 0)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--smoke", action="store_true", help="small sizes and few steps")
    parser.add_argument("--models", type=Path, help="a folder of each family's model, named "
                        "for it (--prepare makes one); default: built now, test preset")
    parser.add_argument("--prepare", type=Path, help="build the models' folder and exit")
    parser.add_argument("--preset", default="default", help="the preset --prepare builds")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--warm-up-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, help="a folder for gpu_check.json")
    args = parser.parse_args()
    if args.prepare is not None:
        prepare(args.prepare, args.preset)
        return
    torch.set_num_threads(1)  # as the workers run; the identity claim's condition on a CPU
    placement = Placement.for_settings(args.device, args.dtype)
    size = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        models = args.models
        if models is None:
            models = Path(scratch)
            prepare(models, "test")
        results = {name: check_family(family_named(name), models / name, placement, size,
                                      args.warm_up_s)
                   for name in args.families}
    device = (torch.cuda.get_device_name(placement.device) if placement.device.type == "cuda"
              else "cpu")
    line = {"bench": "gpu_check", "device": device, "dtype": args.dtype,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "size": size,
            "identical": all(r["identical"] for r in results.values()), "families": results}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(line, indent=1) + "\n")
    report(f"{device}, {args.dtype}: each family's workers' components against its pipeline",
           ["family", "identical", "max diff", "proven sizes", "refused", "rps 1", "rps 8",
            "batching", "first-block"],
           [[name, r["identical"], r["max_abs_diff"], _span(r["proven_batch_sizes"]),
             r["refused_batch_sizes"], r["rps_max_batch_1"], r["rps_max_batch_8"],
             r["batching_ratio"], r["first_block_ratio"]] for name, r in results.items()],
           line)


def _span(sizes: Any) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if sizes else "none"


if __name__ == "__main__":
    main()
