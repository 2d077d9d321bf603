"""Fault injection: seeded requests through ``diffcache up`` while a fixed, seeded schedule
SIGKILLs one child every few seconds, across every role (workers, API, Valkey, storage node,
master). Two denoise workers serve, and every third request carries a LoRA adapter, so jobs are
routed to the inbox of the worker holding it and the kills hit workers with routed jobs in hand.
Every accepted request should end DONE, bit-identical to the monolithic pipeline run quietly in
this process (one thread per op, CPU, float32), with no manual resume, and the takeover, not the
watchdog, should recover every routed job (``rescued`` 0).
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from safetensors.torch import save as save_safetensors

from bench.common import bench_parser, report
from bench.lora import random_lora
from bench.running_service import RunningService
from cachesvc.redis_client import RedisClient
from keys import GenerationSpec, OutputFormat
from keys.names import worker_inboxes
from supervision.processes import free_port
from workers.families import DEFAULT_FAMILY, family_named
from workers.families.base import CPU
from workers.queue.messages import Stage
from workers.queue.submit import new_request_id
from workers.queue.watchdog import read_rescued
from workers.stages.media import decode_npy

ROLES = ("worker-encode-0", "worker-denoise-0", "worker-denoise-1", "worker-decode-0", "api",
         "valkey", "mooncake_client", "mooncake_master")
ADAPTER, SCALE = "faults", 0.8
ADAPTED_EVERY = 3  # every third request carries the adapter
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


def references(model_dir: Path, wanted: list[tuple[GenerationSpec, bool]],
               lora: dict[str, torch.Tensor]) -> list[np.ndarray]:
    """The monolithic pipeline's frames for each spec (with the adapter where it is marked),
    run quietly in this process."""
    torch.set_num_threads(1)  # the workers' condition for bit-identity
    family = family_named(DEFAULT_FAMILY)
    plain, adapted = family.reference(model_dir, CPU), family.reference(model_dir, CPU)
    adapted.pipe.load_lora_weights(lora, adapter_name="a")  # type: ignore[attr-defined]
    adapted.pipe.set_adapters(["a"], [SCALE])  # type: ignore[attr-defined]
    return [(adapted if with_lora else plain)(spec) for spec, with_lora in wanted]


def routed_jobs(client: RedisClient) -> int:
    """Jobs ever added to a worker's inbox (a stream's entries-added survives its trims)."""
    inboxes: set[bytes] = client.smembers(worker_inboxes(Stage.DENOISE.value))  # type: ignore[assignment]
    total = 0
    for inbox in inboxes:
        info: dict[str, Any] = client.xinfo_stream(inbox)
        total += int(info["entries-added"])
    return total


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--every", type=float, default=4.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    parser.add_argument("--spacing", type=float, default=1.0, help="seconds between arrivals")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diffcache-faults-") as tmp:
        model_dir = Path(tmp) / "model"
        family_named(DEFAULT_FAMILY).build(model_dir, "test", 0)
        service = RunningService.start(Path(tmp) / "data", model_dir, free_port("127.0.0.1"),
                                       DIFFCACHE_WORKERS__DENOISE_WORKERS="2")
        lora = random_lora(model_dir, seed=args.seed)
        service.upload_adapter(ADAPTER, save_safetensors(lora))
        stop, killed = threading.Event(), list[str]()
        killer = threading.Thread(target=kill_on_schedule,
                                  args=(service, args.seed, args.every, stop, killed))
        start = time.monotonic()
        try:
            killer.start()
            accepted: dict[str, tuple[GenerationSpec, bool]] = {}
            for n, spec in enumerate(specs(args.requests)):
                with_lora = n % ADAPTED_EVERY == 0
                rid = service.generate(spec, {ADAPTER: SCALE} if with_lora else None)
                accepted[rid] = spec, with_lora
                time.sleep(args.spacing)  # arrivals spread over the kills
            finals = {rid: service.wait(rid) for rid in accepted}
            stop.set()
            killer.join()
            outputs = {rid: decode_npy(service.result(rid)) for rid, f in finals.items()
                       if f["state"] == "DONE"}
            restarts = {n: c["restarts"] for n, c in service.children().items()}
            client = redis.Redis.from_url(service.redis_url)
            routed, rescued = routed_jobs(client), sum(read_rescued(client).values())
        finally:
            stop.set()
            service.kill()
        elapsed = time.monotonic() - start
        expected = references(model_dir, [accepted[rid] for rid in outputs], lora)
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
               "kills": len(killed), "seconds": round(elapsed, 1),
               "routed_jobs": routed, "rescued": rescued})


if __name__ == "__main__":
    main()
