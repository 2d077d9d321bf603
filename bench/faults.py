"""Fault injection: seeded requests through ``diffcache up`` while a fixed, seeded schedule
SIGKILLs one child every few seconds, across every role (workers, API, Valkey, storage node,
master). Every accepted request should end DONE, bit-identical to the monolithic pipeline run
quietly in this process (one thread per op, CPU, float32), with no manual resume.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.common import report
from bench.running_service import RunningService
from cachesvc.processes import free_port
from keys import GenerationSpec, OutputFormat
from workers.families import family_named
from workers.families.base import CPU
from workers.queue.served_model import DEFAULT_FAMILY
from workers.queue.submit import new_request_id
from workers.stages.media import decode_npy

ROLES = ("worker-encode-0", "worker-denoise-0", "worker-decode-0", "api", "valkey",
         "mooncake_client", "mooncake_master")
PROMPTS = ("a red fox in the snow", "a lighthouse at dawn", "two dogs running on a beach",
           "a green train at night", "a small boat on a quiet lake")


def specs(count: int) -> list[GenerationSpec]:
    return [GenerationSpec.create(
        request_id=new_request_id(), tenant="default", prompt=PROMPTS[n % len(PROMPTS)],
        negative_prompt="blurry", width=64, height=64, num_frames=5, num_inference_steps=20,
        guidance_scale=5.0, seed=7000 + n, output_format=OutputFormat.NPY)
        for n in range(count)]


def kill_on_schedule(service: RunningService, seed: int, every_s: float,
                     stop: threading.Event, killed: list[str]) -> None:
    """One SIGKILL every ``every_s`` until ``stop``: rounds over every role, each round in
    an order drawn from ``seed``, so every role is hit as often as the run allows."""
    draw = random.Random(seed)
    while True:
        for name in draw.sample(ROLES, len(ROLES)):
            if stop.wait(every_s):
                return
            service.kill_child(name)
            killed.append(name)


def references(model_dir: Path, wanted: list[GenerationSpec]) -> list[np.ndarray]:
    """The monolithic pipeline's frames for each spec, run quietly in this process."""
    torch.set_num_threads(1)  # the workers' condition for bit-identity
    pipeline = family_named(DEFAULT_FAMILY).reference(model_dir, CPU)
    return [pipeline(spec) for spec in wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--every", type=float, default=4.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    parser.add_argument("--spacing", type=float, default=1.0, help="seconds between arrivals")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diffcache-faults-") as tmp:
        model_dir = Path(tmp) / "model"
        family_named(DEFAULT_FAMILY).build(model_dir, "test", 0)
        service = RunningService.start(Path(tmp) / "data", model_dir, free_port("127.0.0.1"))
        stop, killed = threading.Event(), list[str]()
        killer = threading.Thread(target=kill_on_schedule,
                                  args=(service, args.seed, args.every, stop, killed))
        start = time.monotonic()
        try:
            killer.start()
            accepted: dict[str, GenerationSpec] = {}
            for spec in specs(args.requests):
                accepted[service.generate(spec)] = spec
                time.sleep(args.spacing)  # arrivals spread over the kills
            finals = {rid: service.wait(rid) for rid in accepted}
            stop.set()
            killer.join()
            outputs = {rid: decode_npy(service.result(rid)) for rid, f in finals.items()
                       if f["state"] == "DONE"}
            restarts = {n: c["restarts"] for n, c in service.children().items()}
        finally:
            stop.set()
            service.kill()
        elapsed = time.monotonic() - start
        expected = references(model_dir, [accepted[rid] for rid in outputs])
        identical = all(np.array_equal(frames, want)
                        for frames, want in zip(outputs.values(), expected, strict=True))
    recomputes: Counter[str] = Counter()
    for final in finals.values():
        recomputes.update(final["recomputed"])
    states = Counter(f["state"] for f in finals.values())
    rows = [[name, killed.count(name), restarts.get(name, 0)] for name in ROLES]
    report(f"faults: {len(accepted)} requests in {elapsed:.0f} s, a kill every {args.every} s",
           ["child", "killed", "restarts"], rows, {
               "bench": "faults", "accepted": len(accepted), "done": states["DONE"],
               "failed": states["FAILED"], "manual_resumes": 0,
               "identical": identical and len(outputs) == len(accepted),
               "restarts": restarts, "recomputes": dict(recomputes),
               "kills": len(killed), "seconds": round(elapsed, 1)})


if __name__ == "__main__":
    main()
