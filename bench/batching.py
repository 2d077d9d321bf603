"""The denoise engine's batching: 48 requests of the shipped shapes model (different prompts,
seeds and text lengths) offered at once to the default denoise workers (one per GPU, or per
core on a CPU) with ``max_batch`` 1, 4 and 8, each on a fresh stack so that no cache serves
one round from another; then the same 48 through the shapes model's monolithic diffusers
pipeline, one call per request.

Every output of the batched rounds is compared with the same request's output at max_batch 1
(run alone by the service) and a sample with the pipeline's (one thread per op, as the workers
run). In the max_batch 8 round, interactive requests arrive one at a time while the batch runs:
the time to their first step is set against the engine's step time.
First, the measurement the engine rests on: whether a row of a batched forward is what it is
alone, per family, plainly and with the per-sample layers run apart.
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import bench_parser, model_stack, print_table, report, wait_all, workers
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from config.settings import Settings, WorkerSettings
from keys import GenerationSpec, OutputFormat, Priority, StoreKey
from training.scenes import free_caption, scene_at
from workers.engine.exact_rows import rows_apart
from workers.families import preset_family
from workers.families.base import CPU, Denoiser
from workers.launch import with_worker_counts
from workers.queue.messages import Stage
from workers.queue.metrics.engine import read_join_wait
from workers.queue.records import Records
from workers.queue.schema import Field, RequestRecord
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy

FAMILY = preset_family("shapes")
NEGATIVE = "blurry"
BATCHES = (1, 4, 8)
SAMPLE = 6  # outputs also compared with the pipeline's
INTERACTIVE = 5


def prompts(count: int, seed: int) -> list[str]:
    """Captions of random scenes in their three lengths: full, short, and free phrasings."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        scene = scene_at(seed, i)
        out.append(rng.choice([scene.caption, scene.short_caption(False, False),
                               scene.short_caption(True, False), free_caption(scene, seed, i)]))
    return out


def make_spec(prompt: str, seed: int, priority: Priority = Priority.BATCH) -> GenerationSpec:
    return GenerationSpec.create(request_id=new_request_id(), tenant="bench", prompt=prompt,
                                 negative_prompt=NEGATIVE, width=32, height=32, num_frames=1,
                                 num_inference_steps=20, guidance_scale=4.0, seed=seed,
                                 output_format=OutputFormat.NPY, priority=priority)


def output(settings: Settings, record: RequestRecord) -> np.ndarray:
    cache = open_cache(settings)
    try:
        assert record.output_key is not None
        data = cache.get(StoreKey.parse(record.output_key), lookup=False)
        assert data is not None, f"output of {record.spec.request_id} is gone"
        return decode_npy(data.numpy().tobytes())
    finally:
        cache.close()


def one_round(max_batch: int, work: list[tuple[str, int]], interactive: bool
              ) -> tuple[float, list[np.ndarray], dict[str, float]]:
    """Seconds for the default denoise workers of ``max_batch`` to serve ``work``, its outputs,
    and the round's engine figures."""
    with model_stack(family=FAMILY.name, model={"preset": "shapes"}) as base:
        settings = base.model_copy(update={"workers": WorkerSettings(max_batch=max_batch)})
        client = open_redis(settings)
        records = Records(client)
        specs = [make_spec(p, s) for p, s in work]
        figures: dict[str, float] = {}
        with workers(settings, settings.data_dir / "logs"):
            start = time.perf_counter()
            for spec in specs:
                submit(client, spec)
            probe = (threading.Thread(target=_interactive_probe, args=(records, specs, figures))
                     if interactive else None)
            if probe is not None:
                probe.start()
            done = wait_all(records, specs, poll_s=0.05)
            seconds = time.perf_counter() - start
            if probe is not None:
                probe.join()
        finished = [done[s.request_id] for s in specs]
        steps = [r.stage_seconds()[Stage.DENOISE] / r.spec.num_inference_steps
                 for r in finished]
        figures["step_ms"] = statistics.median(steps) * 1000
        wait = read_join_wait(client).quantile(0.5)
        figures["join_wait_ms_p50"] = (wait or 0.0) * 1000
        return seconds, [output(settings, r) for r in finished], figures


def _interactive_probe(records: Records, batch: list[GenerationSpec],
                       figures: dict[str, float]) -> None:
    """Interactive requests, one at a time, once a quarter of the batch is done: the
    milliseconds from each one's submission to its first step."""
    client = records.redis

    def done_count() -> int:
        return sum(1 for state in records.states([(s.tenant, s.request_id) for s in batch])
                   if state is not None and state.terminal)

    wait_until(lambda: done_count() >= len(batch) // 4, timeout_s=3600, interval_s=0.05,
               what="a quarter of the batch done")
    firsts = []
    for n in range(INTERACTIVE):
        spec = make_spec("a small red circle on a blue background", 9000 + n,
                         Priority.INTERACTIVE)
        submit(client, spec)
        start = time.perf_counter()
        wait_until(functools.partial(_stepped, records, spec), timeout_s=600,
                   interval_s=0.002, what=f"{spec.request_id}'s first step")
        firsts.append((time.perf_counter() - start) * 1000)
        wait_all(records, [spec], poll_s=0.02)
    figures["interactive_first_step_ms_p50"] = statistics.median(firsts)


def _stepped(records: Records, spec: GenerationSpec) -> bool:
    # The step field alone: this is asked every 2 ms, beside the engine it measures.
    step = records.field_of([(spec.tenant, spec.request_id)], Field.STEP)[0]
    return step is not None and int(step) >= 1


def monolithic(model_dir: Path, work: list[tuple[str, int]]) -> tuple[float, list[np.ndarray]]:
    pipeline = FAMILY.reference(model_dir, CPU)
    specs = [make_spec(p, s) for p, s in work]
    start = time.perf_counter()
    outputs = [pipeline(spec) for spec in specs]
    return time.perf_counter() - start, outputs


def invariance() -> list[list[object]]:
    """Per family: the largest difference between row 0 of a batch and that row alone, at
    batch sizes 1-8 of rows with other inputs and timesteps (text of one length per forward),
    plainly and within ``rows_apart``."""
    import tempfile

    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, preset in ((preset_family("shapes"), "shapes"),
                               (preset_family("default"), "default")):
            name = family.name
            directory = Path(tmp) / name
            family.build(directory, preset, 0)
            model = family.denoiser(directory, CPU)
            for label, apart in (("plain", False), ("rows apart", True)):
                table.append([name, label, *_row_differences(model, apart)])
    return table


def _row_differences(model: Denoiser, apart: bool) -> list[object]:
    spec = GenerationSpec.create(request_id="probe", tenant="bench", prompt="x", width=32,
                                 height=32, num_frames=5, num_inference_steps=4, seed=0,
                                 guidance_scale=1.0)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn((8, *model.latent_shape(spec)[1:]), generator=g)
    embeds = torch.randn((8, 12, _text_dim(model.transformer)), generator=g)
    steps = torch.rand(8, generator=g) * 1000
    alone = model.predict(latents[:1], steps[:1], embeds[:1], spec)
    diffs: list[object] = []
    for b in range(1, 9):
        with rows_apart() if apart else contextlib.nullcontext():
            out = model.predict(latents[:b], steps[:b], embeds[:b], spec)
        diffs.append(float((out[:1] - alone).abs().max()))
    return diffs


def _text_dim(transformer: torch.nn.Module) -> int:
    config: Any = transformer.config
    return int(getattr(config, "joint_attention_dim", None) or config.text_dim)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_table("A row of a batched forward against that row alone: largest difference",
                ["family", "forward", *(f"batch {b}" for b in range(1, 9))], invariance())
    rng = random.Random(args.seed)
    work = [(p, rng.randrange(2**31)) for p in prompts(args.requests, args.seed)]
    rounds = {b: one_round(b, work, interactive=b == max(BATCHES)) for b in BATCHES}
    with model_stack(family=FAMILY.name, model={"preset": "shapes"}) as settings:
        torch.set_num_threads(torch.get_num_interop_threads())  # the pipeline at full width
        mono_s, _ = monolithic(settings.model_dir, work)
        torch.set_num_threads(1)
        _, sample = monolithic(settings.model_dir, work[:SAMPLE])
    alone = rounds[1][1]
    identical = all(np.array_equal(a, b) for _, outs, _ in rounds.values()
                    for a, b in zip(outs, alone, strict=True))
    identical = identical and all(np.array_equal(a, b)
                                  for a, b in zip(alone[:SAMPLE], sample, strict=True))
    rps = {str(b): round(len(work) / s, 4) for b, (s, _, _) in rounds.items()}
    mono_rps = len(work) / mono_s
    figures = rounds[max(BATCHES)][2]
    result: dict[str, object] = {
        "bench": "batching", "requests": len(work), "rps": rps,
        "throughput_ratio_8": round(rps["8"] / rps["1"], 3),
        "ratio_to_monolithic": round(rps["8"] / mono_rps, 3),
        "identical": identical,
        "join_wait_ms_p50": round(figures["join_wait_ms_p50"], 1),
        "interactive_first_step_ms_p50": round(figures["interactive_first_step_ms_p50"], 1),
    }
    rows: list[list[object]] = [[f"diffcache, max_batch {b}", s, len(work) / s,
                                 round_figures["step_ms"]]
                                for b, (s, _, round_figures) in rounds.items()]
    rows.append([f"{FAMILY.pipeline_class}, one call each", mono_s, mono_rps, ""])
    denoisers = with_worker_counts(settings, torch.cuda.device_count()).workers.denoise_workers
    report(f"{len(work)} shapes requests offered at once, {denoisers} denoise worker(s)",
           ["run", "seconds", "requests/s", "step ms (median)"], rows, result)


if __name__ == "__main__":
    main()
