"""The CFG unconditional cache: the exact tier's saved forwards, and the interval tier's
trade of forwards for quality.

(a) Seeded prompt variations (10 prompts x one seed x 3 negative prompts), exact tier on versus
off (``cfg_cache.mode`` exact / off): the ratio of denoiser forward calls, read from the
records, and every output compared bit for bit.
(b) The first 10 of those requests with ``interval`` k = 2, 3, 5 against the exact outputs:
the share of forwards saved, PSNR and max absolute error of the frames.
Each run has a tenant of its own, so no run reuses another's entries.
"""

from __future__ import annotations

import math

import numpy as np

from bench.common import bench_parser, model_stack, report, serve, workers
from bench.workload import NEGATIVE_PROMPTS, prompt_pool
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import CfgCache, CfgMode, GenerationSpec, OutputFormat
from workers.queue.records import Records
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id

SEED = 1234


def workload(settings: Settings, tenant: str, cfg: CfgCache, count: int) -> list[GenerationSpec]:
    m = request_defaults(settings.model, settings.model_dir)
    prompts = prompt_pool(10, seed=3)
    pairs = [(p, n) for n in NEGATIVE_PROMPTS for p in prompts][:count]
    return [GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=p, negative_prompt=n,
        width=m.width, height=m.height, num_frames=m.num_frames,
        num_inference_steps=m.num_inference_steps, guidance_scale=m.guidance_scale,
        seed=SEED, output_format=OutputFormat.NPY, cfg_cache=cfg) for p, n in pairs]


def run(records: Records, cache: TensorCache,
        specs: list[GenerationSpec]) -> tuple[int, list[np.ndarray]]:
    """Forward calls and output frames of ``specs``, submitted together."""
    done, frames = serve(records, cache, specs)
    return sum(r.counter("forwards") for r in done), frames


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--quality-requests", type=int, default=10)
    parser.add_argument("--intervals", type=int, nargs="+", default=[2, 3, 5])
    args = parser.parse_args()
    with model_stack() as settings:
        records = Records(open_redis(settings))
        cache = open_cache(settings)
        with workers(settings, settings.data_dir / "logs"):
            off_forwards, exact = run(records, cache, workload(
                settings, "exact-off", CfgCache(CfgMode.OFF), args.requests))
            on_forwards, cached = run(records, cache, workload(
                settings, "exact-on", CfgCache(CfgMode.EXACT), args.requests))
            identical = all(np.array_equal(a, b) for a, b in zip(exact, cached, strict=True))
            n = args.quality_requests
            base = off_forwards * n / args.requests  # every request runs the same forwards
            interval = []
            for k in args.intervals:
                forwards, frames = run(records, cache, workload(
                    settings, f"interval-{k}", CfgCache(CfgMode.INTERVAL, k), n))
                scores = [psnr(a, b) for a, b in zip(exact[:n], frames, strict=True)]
                interval.append({
                    "k": k, "saved": round(1 - forwards / base, 4),
                    "psnr_db": round(float(np.mean(scores)), 2),
                    "max_abs_err": int(max(np.abs(a.astype(int) - b.astype(int)).max()
                                           for a, b in zip(exact[:n], frames, strict=True)))})
        cache.close()
    rows: list[list[object]] = [
        ["exact tier off", off_forwards, "", "", "bit-identical" if identical else "DIFFERENT"],
        ["exact tier on", on_forwards, f"{1 - on_forwards / off_forwards:.4f}", "", ""]]
    rows += [[f"interval k={r['k']} ({n} requests)", "", r["saved"], r["psnr_db"],
              f"max abs err {r['max_abs_err']}"] for r in interval]
    report("CFG unconditional cache", ["run", "forwards", "saved", "PSNR dB", "output"], rows,
           {"bench": "cfg_cache", "exact_forward_ratio": round(on_forwards / off_forwards, 4),
            "exact_identical": identical, "interval": interval})
    if not identical:
        raise SystemExit("the exact tier changed an output")


if __name__ == "__main__":
    main()
