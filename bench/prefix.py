"""Trajectory-prefix sharing: a prompt-editing workload with prefix reuse on and off.

Each group is one seed and one first-half prompt; its variations keep that first half and
change the prompt for the second half (a ``[from:to:when]`` edit). A group's first request runs,
then its variations are submitted together, as a user edits after seeing a result.
Reuse on: every request of a phase shares one tenant, so variations find the first request's
checkpoint at the switch. Reuse off: every request has a tenant of its own, and nothing is
shared. Steps computed are read from the records (steps minus the step each one resumed from).
"""

from __future__ import annotations

import argparse
import time

from bench.common import bench_parser, model_stack, report, wait_all, workers
from bench.workload import ACTIONS, PLACES, SUBJECTS
from cachesvc.redis_client import open_redis
from config.settings import Settings
from keys import GenerationSpec, OutputFormat, PromptSegment
from workers.queue.records import Records
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id, submit


def group(settings: Settings, n: int, variations: int, tenant: str | None) -> list[
        GenerationSpec]:
    m = request_defaults(settings.model, settings.model_dir)
    steps, half = m.num_inference_steps, m.num_inference_steps // 2
    first = f"a {SUBJECTS[n % len(SUBJECTS)]} {ACTIONS[n % len(ACTIONS)]}"
    specs = []
    for v in range(variations):
        schedule = (PromptSegment(first, "blurry", half),
                    PromptSegment(f"{first} {PLACES[v % len(PLACES)]}", "blurry", steps))
        specs.append(GenerationSpec.create(
            request_id=new_request_id(), tenant=tenant or f"solo{n}-{v}", prompt="",
            schedule=schedule, width=m.width, height=m.height, num_frames=m.num_frames,
            num_inference_steps=steps, guidance_scale=m.guidance_scale, seed=100 + n,
            output_format=OutputFormat.MP4))
    return specs


def phase(settings: Settings, reuse: bool, args: argparse.Namespace) -> dict[str, float]:
    client = open_redis(settings)
    records = Records(client)
    groups = [group(settings, n, args.variations, "shared" if reuse else None)
              for n in range(args.groups)]
    computed = 0
    with workers(settings, settings.data_dir / "logs" / ("on" if reuse else "off")):
        start = time.perf_counter()
        for specs in groups:
            submit(client, specs[0])
            wait_all(records, specs[:1])
            for spec in specs[1:]:
                submit(client, spec)
            done = wait_all(records, specs)
            computed += sum(spec.num_inference_steps - done[spec.request_id].counter(
                "resumed_from") for spec in specs)
        seconds = time.perf_counter() - start
    return {"steps_computed": computed, "seconds": seconds}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--variations", type=int, default=4)
    args = parser.parse_args()
    with model_stack() as settings:
        off = phase(settings, False, args)
        on = phase(settings, True, args)
    steps = request_defaults(settings.model, settings.model_dir).num_inference_steps
    total = args.groups * args.variations * steps
    # Steps that lie in a prefix an earlier request of the group already computed.
    shared = args.groups * (args.variations - 1) * (steps // 2)
    result = {"bench": "prefix",
              "steps_computed_ratio": round(on["steps_computed"] / off["steps_computed"], 4),
              "shared_prefix_share": round(shared / total, 4),
              "seconds_ratio": round(on["seconds"] / off["seconds"], 4)}
    report(f"{args.groups} groups x {args.variations} edits of the second half, "
           f"{steps} steps each", ["prefix reuse", "steps computed", "seconds"],
           [["off", int(off["steps_computed"]), off["seconds"]],
            ["on", int(on["steps_computed"]), on["seconds"]]], result)


if __name__ == "__main__":
    main()
