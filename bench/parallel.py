"""A denoise worker over two ranks against one: one request of the default Wan model denoised
by the engine's executor, its conditional and unconditional rows a forward a step, on 1 rank
and on 2 (gloo, one thread per op each: the machine's two cores), each forward's sequence
split by Ulysses through diffusers' context parallelism.

Each trajectory is run again the way the pipeline calls the transformer (each row alone, the
transformer split alike on as many ranks) and compared: ``identical`` is whether the executor's
latents are those, bit for bit, on both rank counts. Whether 2 ranks give 1 rank's bits is
printed beside it (a split may round differently; keys name the split). The stand-in update
between steps is the same arithmetic on every run. Rows split across ranks (the issue's second
figure) are not built yet: ``rows_throughput_ratio`` is null.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from bench.common import bench_parser, report
from cachesvc.processes import free_port
from keys import GenerationSpec
from workers.engine.executor import Executor
from workers.engine.guidance import Row
from workers.families import wan
from workers.families.base import CPU, Denoiser
from workers.parallel.group import run_forwards
from workers.parallel.layout import ParallelLayout
from workers.parallel.wire import Wire


def trajectory(model: Denoiser, spec: GenerationSpec, forward: object) -> torch.Tensor:
    """``spec``'s latents after its steps, each step's two rows through ``forward``."""
    latents, generator = model.initial_latents(spec)
    tokens, width = model.text_shape()
    cond = torch.randn(1, tokens, width, generator=generator)
    uncond = torch.randn(1, tokens, width, generator=generator)
    for t in model.scheduler(spec).timesteps:
        out = forward(latents, t, cond, uncond)  # type: ignore[operator]
        latents = latents - 0.05 * (out[0:1] + 4.0 * (out[0:1] - out[1:2]))
    return latents


def _rank(rank: int, ranks: int, port: int, model_dir: Path, spec: GenerationSpec,
          warm: GenerationSpec, out: Path) -> None:
    torch.set_num_threads(1)
    model = wan.FAMILY.denoiser(model_dir, CPU)
    wire = Wire(torch.device("cpu"))
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ranks, timeout=timedelta(minutes=30))
        ParallelLayout(ulysses=ranks).enable(model.transformer)

    def alone(latents: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
              uncond: torch.Tensor) -> torch.Tensor:
        return torch.cat([model.predict(latents, t.reshape(1), e, spec) for e in (cond, uncond)])

    with torch.no_grad():
        if rank > 0:
            run_forwards(model, wire)  # the executor's forwards, until rank 0 says stop
            trajectory(model, spec, alone)
            return
        executor = Executor(model, parallel=False, mirror=wire.send if ranks > 1 else None)

        def engine(latents: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
                   uncond: torch.Tensor) -> torch.Tensor:
            return executor.forward([Row(latents, t, cond, spec), Row(latents, t, uncond, spec)])[0]

        trajectory(model, warm, engine)  # the batch of two proven, the kernels warm
        start = time.perf_counter()
        served = trajectory(model, spec, engine)
        seconds = time.perf_counter() - start
        if ranks > 1:
            wire.send(None)
        direct = trajectory(model, spec, alone)
    torch.save({"seconds": seconds, "served": served, "direct": direct}, out)


@dataclass(frozen=True, slots=True)
class Measured:
    seconds: float  # the request's steps through the executor
    served: torch.Tensor  # its latents so
    direct: torch.Tensor  # its latents as the pipeline calls the transformer

    @property
    def identical(self) -> bool:
        return torch.equal(self.served, self.direct)


def run(model_dir: Path, spec: GenerationSpec, ranks: int, scratch: Path) -> Measured:
    out = scratch / f"ranks-{ranks}.pt"
    warm = video(spec.width, spec.height, spec.num_frames, 2)
    spawn(_rank, args=(ranks, free_port("127.0.0.1"), model_dir, spec, warm, out),
          nprocs=ranks)
    saved = torch.load(out, weights_only=True)  # tensors and a float: nothing unpickled
    return Measured(float(saved["seconds"]), saved["served"], saved["direct"])


def video(width: int, height: int, frames: int, steps: int) -> GenerationSpec:
    return GenerationSpec.create(request_id="bench-parallel", tenant="bench", prompt="",
                                 width=width, height=height, num_frames=frames,
                                 num_inference_steps=steps, guidance_scale=5.0, seed=7)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--size", default="256x256", help="width x height of the video")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    width, height = (int(side) for side in args.size.split("x"))
    spec = video(width, height, args.frames, args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "wan"
        wan.build(model_dir, "default")
        tokens = wan.FAMILY.denoiser(model_dir, CPU).tokens(spec)
        one, two = (run(model_dir, spec, ranks, Path(scratch)) for ranks in (1, 2))
    ratio = one.seconds / two.seconds
    report("One Wan request, Ulysses over gloo ranks (one thread each)",
           ["ranks", "seconds", "latency ratio", "= the pipeline's calls, split alike"],
           [[1, f"{one.seconds:.2f}", "1.00", one.identical],
            [2, f"{two.seconds:.2f}", f"{ratio:.2f}", two.identical]],
           {"bench": "parallel", "ranks": 2, "video_latency_ratio": round(ratio, 3),
            "rows_throughput_ratio": None, "identical": one.identical and two.identical,
            "two_ranks_equal_one": torch.equal(one.served, two.served), "size": args.size,
            "frames": args.frames, "steps": args.steps, "tokens": tokens})


if __name__ == "__main__":
    main()
