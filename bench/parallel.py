"""A denoise worker over two ranks against one (gloo, one thread per op each: the machine's
two cores), through the engine's executor as a group's rank 0 runs it:

- video: one request of the built-in text-to-video family's default model, its conditional
  and unconditional rows a forward a step, each forward's sequence split by Ulysses
  (diffusers' context parallelism); the figure is its latency on 1 rank over 2.
- rows: a batch of 8 requests of the text-to-image family's default model, texts of three
  lengths, their 8 conditional and 8 unconditional rows two forwards a step (as ``max_batch``
  8 cuts them), each forward's rows shared out over the ranks; the figure is requests a
  second on 2 ranks over 1.

Each run is computed again as the pipeline calls the transformer (each row alone, the
transformer split alike) and compared: ``identical`` is whether every run's latents are those,
bit for bit. Rows split are also one rank's bits (printed); a sequence split may round
differently (keys name it). The stand-in update between steps is the same on every run.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from bench.common import bench_parser, report
from keys import GenerationSpec
from supervision.processes import free_port
from workers.engine.executor import Executor
from workers.engine.guidance import Row
from workers.families import built_in_for, family_named
from workers.families.base import CPU, Denoiser
from workers.parallel.group import SplitForwards, run_forwards
from workers.parallel.layout import ParallelLayout
from workers.parallel.wire import Wire
from workers.queue.served_model import Workflow

# A step's rows, [conditional rows, unconditional rows], to their outputs in that order.
Forward = Callable[[list[Row], list[Row]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Case:
    family: str
    layout: ParallelLayout  # on two ranks
    specs: tuple[GenerationSpec, ...]
    texts: tuple[int, ...]  # each request's text length (the family's typical one if 0)


def trajectories(model: Denoiser, case: Case, forward: Forward, steps: int | None = None
                 ) -> torch.Tensor:
    """Every request's latents after its steps (``steps``, if given), each step's rows
    through ``forward``."""
    tokens, width = model.text_shape()
    latents, conds, unconds = [], [], []
    for spec, text in zip(case.specs, case.texts, strict=True):
        start, generator = model.initial_latents(spec)
        latents.append(start)
        conds.append(torch.randn(1, text or tokens, width, generator=generator))
        unconds.append(torch.randn(1, text or tokens, width, generator=generator))
    for t in model.scheduler(case.specs[0]).timesteps[:steps]:
        rows = list(zip(latents, conds, unconds, case.specs, strict=True))
        out = forward([Row(x, t, c, s) for x, c, _, s in rows],
                      [Row(x, t, u, s) for x, _, u, s in rows])
        n = len(latents)
        latents = [x - 0.05 * (out[i:i + 1] + 4.0 * (out[i:i + 1] - out[n + i:n + i + 1]))
                   for i, x in enumerate(latents)]
    return torch.cat(latents)


def _rank(rank: int, ranks: int, port: int, model_dir: Path, case: Case, out: Path) -> None:
    torch.set_num_threads(1)
    model = family_named(case.family).denoiser(model_dir, CPU)
    layout = case.layout if ranks > 1 else ParallelLayout()
    wire = Wire(torch.device("cpu"))
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ranks, timeout=timedelta(minutes=30))
        layout.enable(model.transformer)

    def alone(conds: list[Row], unconds: list[Row]) -> torch.Tensor:
        return torch.cat([model.predict(r.latents, r.timestep.reshape(1), r.embeds, r.spec)
                          for r in conds + unconds])

    with torch.no_grad():
        if rank > 0:
            # The executor's forwards, until rank 0 says stop.
            run_forwards(model, wire, layout, rank, CPU.dit_dtype)
            if layout.sequence_ranks > 1:
                trajectories(model, case, alone)  # its part of rank 0's sequence
            return
        executor = Executor(model, parallel=False,
                            ranks=SplitForwards(wire, layout, CPU.dit_dtype)
                            if ranks > 1 else None)

        def served(conds: list[Row], unconds: list[Row]) -> torch.Tensor:
            return torch.cat([executor.forward(conds)[0], executor.forward(unconds)[0]])

        trajectories(model, case, served, steps=2)  # batch sizes proven, kernels warm
        start = time.perf_counter()
        latents = trajectories(model, case, served)
        seconds = time.perf_counter() - start
        if ranks > 1:
            wire.send(None)
        direct = trajectories(model, case, alone)
    torch.save({"seconds": torch.tensor(seconds), "served": latents, "direct": direct}, out)


@dataclass(frozen=True, slots=True)
class Measured:
    seconds: float  # the steps of every request, through the executor
    served: torch.Tensor  # the latents so
    direct: torch.Tensor  # the latents as the pipeline calls the transformer

    @property
    def identical(self) -> bool:
        return torch.equal(self.served, self.direct)


def run(model_dir: Path, case: Case, ranks: int, scratch: Path) -> Measured:
    out = scratch / f"{case.family}-{ranks}.pt"
    spawn(_rank, args=(ranks, free_port("127.0.0.1"), model_dir, case, out), nprocs=ranks)
    saved = torch.load(out, weights_only=True)  # tensors only: nothing unpickled
    return Measured(float(saved["seconds"]), saved["served"], saved["direct"])


def spec(width: int, height: int, frames: int, steps: int, seed: int) -> GenerationSpec:
    return GenerationSpec.create(request_id=f"bench-parallel-{seed}", tenant="bench",
                                 prompt="", width=width, height=height, num_frames=frames,
                                 num_inference_steps=steps, guidance_scale=5.0, seed=seed)


def measure(case: Case, scratch: Path) -> tuple[Measured, Measured, int]:
    """``case`` on 1 rank and on 2, and the image tokens of one of its rows."""
    model_dir = scratch / case.family
    family = family_named(case.family)
    family.build(model_dir, "default", 0)
    tokens = family.denoiser(model_dir, CPU).tokens(case.specs[0])
    return run(model_dir, case, 1, scratch), run(model_dir, case, 2, scratch), tokens


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--video", default="256x256x17", help="width x height x frames")
    parser.add_argument("--image", default="256x256", help="width x height of each image")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    w, h, frames = (int(n) for n in args.video.split("x"))
    video = Case(built_in_for(Workflow.TEXT_TO_VIDEO).name, ParallelLayout(ulysses=2),
                 (spec(w, h, frames, args.steps, 7),), (0,))
    w, h = (int(n) for n in args.image.split("x"))
    images = Case(built_in_for(Workflow.TEXT_TO_IMAGE).name, ParallelLayout(rows=2),
                  tuple(spec(w, h, 1, args.steps, seed) for seed in range(8)),
                  tuple(12 + seed % 3 for seed in range(8)))
    with tempfile.TemporaryDirectory() as scratch:
        one, two, video_tokens = measure(video, Path(scratch))
        one_rows, two_rows, image_tokens = measure(images, Path(scratch))
    latency = one.seconds / two.seconds
    throughput = one_rows.seconds / two_rows.seconds
    runs = (one, two, one_rows, two_rows)
    report("Two gloo ranks against one (one thread per op each)",
           ["case", "ranks", "seconds", "ratio", "= the pipeline's calls, split alike"],
           [["video, Ulysses", 1, f"{one.seconds:.2f}", "", one.identical],
            ["video, Ulysses", 2, f"{two.seconds:.2f}", f"{latency:.2f}", two.identical],
            ["8 images, rows", 1, f"{one_rows.seconds:.2f}", "", one_rows.identical],
            ["8 images, rows", 2, f"{two_rows.seconds:.2f}", f"{throughput:.2f}",
             two_rows.identical]],
           {"bench": "parallel", "ranks": 2, "video_latency_ratio": round(latency, 3),
            "rows_throughput_ratio": round(throughput, 3),
            "identical": all(m.identical for m in runs),
            "video_two_ranks_equal_one": torch.equal(one.served, two.served),
            "rows_two_ranks_equal_one": torch.equal(one_rows.served, two_rows.served),
            "video": args.video, "video_tokens": video_tokens, "image": args.image,
            "image_tokens": image_tokens, "steps": args.steps})


if __name__ == "__main__":
    main()
