"""Output quality of the trained shapes model, and what each approximate tier costs in it.

A fixed set of (prompt, seed) pairs (each prompt the full caption of a scene of a held-out
dataset seed) goes through the service: once exact, once per interval CFG tier, and once more
exact with each prompt in a free phrasing (no articles, "on white", commas, background
first), and once per step-cache policy setting. Each scene's render is also recoloured by
prompt (image-to-image) at two strengths. The shipped attribute classifier reads every
output; the report gives, per attribute, the share that shows what the prompt asked (for
image-to-image: the colour asked, and the input's shape kept); per tier and policy, the
forwards saved (for a step cache: the share of forwards it stood in for part of), the change
in accuracy, and paired PSNR and SSIM against the exact output of the same pair; and for every
run an FID-style distance to the ground-truth renders, on the classifier's features.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)
from torchmetrics.image.fid import FrechetInceptionDistance

from bench.cfg_cache import run
from bench.common import bench_parser, model_stack, report, serve, workers
from bench.image_inputs import STRENGTHS, Target, other_colours, readings, recoloured
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import CfgCache, CfgMode, GenerationSpec, OutputFormat, StepCache, StepCachePolicy
from training.classifier import AttributeClassifier, load_classifier
from training.scenes import Colour, Scene, Shape, Size, free_caption, scene_at
from training.scenes import Position as Where
from workers.queue.records import Records
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id

HELD_OUT = 500  # the dataset seed of the prompts: neither the model's nor the classifier's
READ = ("color", "shape", "position")  # the attributes the goal names
EXACT_STEPS = StepCache()


@dataclass(frozen=True, slots=True)
class Outputs:
    frames: np.ndarray  # (N, H, W, 3) uint8
    forwards: int


def specs_for(settings: Settings, tenant: str, scenes: list[Scene], cfg: CfgCache,
              first_seed: int, prompts: list[str] | None = None,
              step_cache: StepCache = EXACT_STEPS) -> list[GenerationSpec]:
    """One request per scene, prompted by its full caption unless ``prompts`` are given."""
    m = request_defaults(settings.model, settings.model_dir)
    return [GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt=prompt, width=m.width,
        height=m.height, num_frames=1, num_inference_steps=m.num_inference_steps,
        guidance_scale=m.guidance_scale, seed=first_seed + i, output_format=OutputFormat.NPY,
        cfg_cache=cfg, step_cache=step_cache)
        for i, prompt in enumerate(prompts or [scene.caption for scene in scenes])]


def accuracy(classifier: AttributeClassifier, frames: np.ndarray,
             scenes: list[Scene]) -> dict[str, float]:
    read = classifier.read(frames)
    wanted = [scene.labels() for scene in scenes]
    return {name: round(float(np.mean(read[name] == [w[name] for w in wanted])), 4)
            for name in read}


def distance(classifier: AttributeClassifier, frames: np.ndarray,
             truth: np.ndarray) -> float:
    """Frechet distance between the two sets' classifier features."""
    fid = FrechetInceptionDistance(feature=classifier, normalize=False)
    fid.update(torch.from_numpy(truth).permute(0, 3, 1, 2), real=True)
    fid.update(torch.from_numpy(frames).permute(0, 3, 1, 2), real=False)
    return round(float(fid.compute()), 3)


def paired(frames: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """Mean PSNR (dB) and SSIM of each output against the exact output of its pair."""
    a = torch.from_numpy(frames).permute(0, 3, 1, 2).double()
    b = torch.from_numpy(exact).permute(0, 3, 1, 2).double()
    psnr = peak_signal_noise_ratio(a, b, data_range=255.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(a, b, data_range=255.0, reduction="none")
    assert isinstance(ssim, torch.Tensor)
    return round(float(psnr.clamp(max=100).mean()), 2), round(float(ssim.mean()), 4)


def grid_scenes() -> list[Scene]:
    """One row per shape, one column per colour, each on the next colour's background."""
    colours = list(Colour)
    return [Scene(c, shape, Size.LARGE, Where.CENTER, colours[(i + 2) % len(colours)])
            for shape in Shape for i, c in enumerate(colours)]


def write_grid(frames: np.ndarray, columns: int, path: Path, scale: int = 4) -> None:
    rows = len(frames) // columns
    h, w = frames.shape[1:3]
    sheet = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        r, c = divmod(i, columns)
        sheet[r * h:(r + 1) * h, c * w:(c + 1) * w] = frame
    image = Image.fromarray(sheet).resize((columns * w * scale, rows * h * scale),
                                          Image.Resampling.NEAREST)
    image.save(path)


def image_to_image(settings: Settings, records: Records, cache: TensorCache,
                   scenes: list[Scene]) -> dict[float, tuple[int, float, float]]:
    """Each scene's render recoloured by prompt (a colour of its others, in turn) at each
    strength: per strength, the count, the colour asked read back and the shape kept."""
    strengths = STRENGTHS["image-to-image"]
    edits = [edit for i, scene in enumerate(scenes) for edit in recoloured(
        settings, cache, scene, [Target(other_colours(scene)[i % 6], strength)
                                 for strength in strengths], 1000 + len(strengths) * i)]
    _, frames = serve(records, cache, [edit.spec for edit in edits])
    return {strength: read for (_, strength), read in
            readings(np.concatenate(frames), edits).items()}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--intervals", type=int, nargs="*", default=[2, 3, 5])
    parser.add_argument("--first-block", type=float, nargs="*", default=[0.1, 0.2, 0.3],
                        help="first-block cache thresholds")
    parser.add_argument("--taylorseer", type=int, nargs="*", default=[2, 3, 5],
                        help="TaylorSeer intervals (warm-up 3, order 1)")
    parser.add_argument("--magcache", type=float, nargs="*", default=[0.06, 0.12, 0.24],
                        help="MagCache thresholds (the model card's ratios, at most 3 skipped "
                        "in a row)")
    parser.add_argument("--grid", type=Path, help="also write a PNG grid of sample outputs")
    args = parser.parse_args()
    classifier = load_classifier()
    scenes = [scene_at(HELD_OUT, i) for i in range(args.requests)]
    truth = np.stack([np.asarray(s.render()) for s in scenes])
    results: dict[str, Outputs] = {}
    step_caches = ([StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=t)
                    for t in args.first_block]
                   + [StepCache.create(StepCachePolicy.TAYLORSEER, interval=k)
                      for k in args.taylorseer]
                   + [StepCache.create(StepCachePolicy.MAGCACHE, threshold=t)
                      for t in args.magcache])
    skipped: dict[StepCache, float] = {}  # the share of forwards each policy stood in for
    with model_stack(model={"preset": "shapes"}) as settings:
        records = Records(open_redis(settings))
        cache = open_cache(settings)
        with workers(settings, settings.data_dir / "logs"):
            tiers = {"exact": CfgCache(CfgMode.EXACT)}
            tiers |= {f"interval-{k}": CfgCache(CfgMode.INTERVAL, k) for k in args.intervals}
            for name, cfg in tiers.items():
                forwards, frames = run(records, cache,
                                       specs_for(settings, name, scenes, cfg, 1000))
                results[name] = Outputs(np.concatenate(frames), forwards)
            for n, step_cache in enumerate(step_caches):
                done, frames = serve(records, cache, specs_for(
                    settings, f"step-{n}", scenes, CfgCache(CfgMode.EXACT), 1000,
                    step_cache=step_cache))
                results[f"step-{n}"] = Outputs(np.concatenate(frames),
                                               sum(r.counter("forwards") for r in done))
                skipped[step_cache] = (sum(r.counter("hits:step") for r in done)
                                       / sum(r.counter("lookups:step") for r in done))
            # The same scenes and seeds, each prompted as a person might write it.
            free = [free_caption(scene, HELD_OUT, i) for i, scene in enumerate(scenes)]
            forwards, frames = run(records, cache, specs_for(
                settings, "free", scenes, CfgCache(CfgMode.EXACT), 1000, free))
            results["free"] = Outputs(np.concatenate(frames), forwards)
            recolour = image_to_image(settings, records, cache, scenes)
            if args.grid is not None:
                examples = grid_scenes()
                _, frames = run(records, cache, specs_for(
                    settings, "grid", examples, CfgCache(CfgMode.EXACT), 7))
                write_grid(np.concatenate(frames), len(Colour), args.grid)
        cache.close()

    exact = results["exact"]
    exact_acc = accuracy(classifier, exact.frames, scenes)
    exact_fid = distance(classifier, exact.frames, truth)
    on_renders = accuracy(classifier, truth, scenes)
    free_acc = accuracy(classifier, results["free"].frames, scenes)
    rows: list[list[object]] = [
        ["ground-truth renders", *(on_renders[a] for a in READ), "", "", "", "",
         distance(classifier, truth, truth)],
        ["exact", *(exact_acc[a] for a in READ), exact.forwards, "", "", "", exact_fid],
        ["free phrasing", *(free_acc[a] for a in READ), results["free"].forwards,
         "", "", "", distance(classifier, results["free"].frames, truth)],
        # Colour: the one the edit asked for; shape: the input image's, kept.
        *([f"image-to-image, strength {strength}", asked, shape, "", "", "", "", "", ""]
          for strength, (_, asked, shape) in recolour.items())]

    def scored(label: str, tier: Outputs, saved: float) -> dict[str, object]:
        """An approximate run against the exact one; its row joins the table."""
        acc = accuracy(classifier, tier.frames, scenes)
        psnr, ssim = paired(tier.frames, exact.frames)
        entry: dict[str, object] = {
            "forwards_saved": round(saved, 4),
            "acc_delta": round(float(np.mean([acc[a] - exact_acc[a] for a in READ])), 4),
            "psnr_db": psnr, "ssim": ssim, "fid": distance(classifier, tier.frames, truth)}
        rows.append([label, *(acc[a] for a in READ), tier.forwards, entry["forwards_saved"],
                     psnr, ssim, entry["fid"]])
        return entry

    interval = [{"k": k, **scored(f"interval k={k}", results[f"interval-{k}"],
                                  1 - results[f"interval-{k}"].forwards / exact.forwards)}
                for k in args.intervals]
    steps = [{"policy": c.policy.value, "params": dict(c.params),
              **scored(" ".join([c.policy.value, *(f"{k}={v}" for k, v in c.params)]),
                       results[f"step-{n}"], skipped[c])}
             for n, c in enumerate(step_caches)]
    report(f"shapes model, {args.requests} (prompt, seed) pairs: attribute accuracy read by "
           "the classifier; PSNR/SSIM against the exact output of the same pair; FID on the "
           "classifier's features against the renders",
           ["run", *READ, "forwards", "saved", "PSNR dB", "SSIM", "FID"], rows,
           {"bench": "quality", "requests": args.requests,
            "exact": {f"{a}_acc": exact_acc[a] for a in READ}
            | {"size_acc": exact_acc["size"], "background_acc": exact_acc["background"],
               "fid": exact_fid},
            "free_phrasing": {f"{a}_acc": free_acc[a] for a in free_acc},
            "classifier_on_renders": {f"{a}_acc": on_renders[a] for a in on_renders},
            "interval": interval, "step_cache": steps,
            "image_to_image": [{"strength": strength, "color_asked_acc": asked,
                                "shape_kept_acc": shape}
                               for strength, (_, asked, shape) in recolour.items()]})


if __name__ == "__main__":
    main()
