"""MagCache's ratios for a model folder, by the published calibration: trajectories of the
model's own kind of prompt run with the hook measuring, never skipping; the mean ratio per
step, over every prompt and both guidance branches, goes into the folder's model card.

    python -m training.magcache --model workers/families/trained/shapes
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline

from config.settings import ModelSettings
from training.scenes import scene_at
from workers.families.step_cache import calibrate_magcache
from workers.queue.served_model import MODEL_CARD, RequestDefaults, request_defaults


def calibrate(directory: Path, prompts: list[str], defaults: RequestDefaults) -> list[float]:
    """The mean MagCache ratio of each step over ``prompts`` (seeds 0, 1, ...), at the
    model's default size, step count and guidance."""
    pipe = DiffusionPipeline.from_pretrained(directory, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # Pipelines name real CFG's scale either true_cfg_scale or guidance_scale.
    takes = inspect.signature(pipe.__call__).parameters
    scale = "true_cfg_scale" if "true_cfg_scale" in takes else "guidance_scale"
    frames = {"num_frames": defaults.num_frames} if "num_frames" in takes else {}
    found: list[list[float]] = []
    for seed, prompt in enumerate(prompts):
        def trajectory(prompt: str = prompt, seed: int = seed) -> object:
            return pipe(prompt, negative_prompt="", width=defaults.width,
                        height=defaults.height, num_inference_steps=defaults.num_inference_steps,
                        output_type="latent", generator=torch.Generator().manual_seed(seed),
                        **{scale: defaults.guidance_scale}, **frames)

        found += calibrate_magcache(pipe.transformer, defaults.num_inference_steps, trajectory)
    return [round(float(r), 6) for r in np.mean(np.array(found), axis=0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16,
                        help="captions of the shapes training set (dataset seed 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    defaults = request_defaults(ModelSettings(), args.model)
    ratios = calibrate(args.model, [scene_at(0, i).caption for i in range(args.prompts)],
                       defaults)
    path = args.model / MODEL_CARD
    card = json.loads(path.read_text()) if path.exists() else {}
    card.setdefault("model", {})["magcache_ratios"] = ratios
    path.write_text(json.dumps(card, indent=1) + "\n")
    print(f"{path}: magcache_ratios for {defaults.num_inference_steps} steps: {ratios}")


if __name__ == "__main__":
    main()
