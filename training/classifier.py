"""The yardstick: a few-layer CNN that reads a scene's attributes back from its pixels.

Trained on ground-truth renders only (never on model outputs), so its reading of a generated
image says whether the image shows what the prompt asked. Its penultimate layer is the
feature space of the FID-style distance in ``bench.quality``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training import checkpoint
from training.phases import Budget, Phase, Run
from training.scenes import ATTRIBUTES, RESOLUTION, scene_at, to_tensor

# The shipped classifier (package data), made by `diffcache model train-classifier`.
SHIPPED = Path(__file__).parent / "trained" / "attribute_classifier.safetensors"
FEATURES = 64


class AttributeClassifier(nn.Module):
    """Three strided convolutions, a feature layer, and one head per attribute."""

    num_features = FEATURES  # read by torchmetrics' FID instead of probing at 299x299

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.GELU(),
            nn.Flatten(), nn.Linear(64 * (RESOLUTION // 4) ** 2, FEATURES), nn.GELU())
        self.heads = nn.ModuleDict({name: nn.Linear(FEATURES, len(classes))
                                    for name, classes in ATTRIBUTES.items()})

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 images to (N, FEATURES) features (the FID's extractor)."""
        return self.body(images.float() / 127.5 - 1.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)

    def logits(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        found = self.features(images)
        return {name: head(found) for name, head in self.heads.items()}

    @torch.no_grad()
    def read(self, frames: np.ndarray) -> dict[str, np.ndarray]:
        """(N, H, W, 3) uint8 frames to each attribute's predicted class index."""
        images = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        return {name: out.argmax(-1).numpy() for name, out in self.logits(images).items()}


@dataclass(frozen=True, slots=True)
class ClassifierPlan:
    seed: int = 100  # a dataset of its own, apart from the generator's
    steps: int = 1500
    batch: int = 128
    lr: float = 2e-3
    noise: float = 8.0  # std of the pixel noise added, in uint8 steps: outputs are not clean
    max_blur: float = 1.5  # largest Gaussian blur sigma, in pixels: nor are they sharp


def blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """A separable Gaussian blur of (N, 3, H, W) images, edges reflected."""
    if sigma < 0.05:
        return images
    taps = torch.arange(-2, 3, dtype=images.dtype)
    kernel = torch.exp(-(taps**2) / (2 * sigma**2))
    kernel = (kernel / kernel.sum()).repeat(3, 1, 1, 1)  # (3, 1, 1, 5): one per channel
    padded = nn.functional.pad(images, (2, 2, 2, 2), mode="reflect")
    rows = nn.functional.conv2d(padded, kernel, groups=3)
    return nn.functional.conv2d(rows, kernel.transpose(2, 3), groups=3)


def train_classifier(plan: ClassifierPlan, out: Path, work: Path, budget: Budget,
                     show_progress: bool = True) -> bool:
    """Train (or resume) in ``work``; True once the weights are written to ``out``."""
    checkpoint.check_plan(plan, work)
    torch.manual_seed(plan.seed)
    model = AttributeClassifier()
    generator = torch.Generator().manual_seed(plan.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr)
    run = Run(work / "checkpoint", {"classifier": model}, generator, budget, show_progress)
    position = checkpoint.read_position(run.directory) or checkpoint.Position("classifier", 0,
                                                                              {})
    if run.directory.exists():
        checkpoint.restore(run.directory, run.modules, optimizer, generator)

    def loss(step: int) -> torch.Tensor:
        scenes = [scene_at(plan.seed, step * plan.batch + i) for i in range(plan.batch)]
        pixels = (to_tensor([s.render() for s in scenes]) + 1.0) * 127.5
        sigma = float(torch.rand((), generator=generator)) * plan.max_blur
        pixels = blur(pixels, sigma)
        noise = torch.randn(pixels.shape, generator=generator) * plan.noise
        images = (pixels + noise).clamp(0, 255).round()
        labels = [s.labels() for s in scenes]
        logits = model.logits(images)
        return sum((nn.functional.cross_entropy(
            logits[name], torch.tensor([label[name] for label in labels]))
            for name in ATTRIBUTES), torch.zeros(()))

    if position.phase == "classifier" and not run.step_through(
            Phase("classifier", plan.steps, optimizer, loss), position.step, {}):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(model.state_dict()), out, metadata={"plan": json.dumps(asdict(plan))})
    return True


def load_classifier(path: Path = SHIPPED) -> AttributeClassifier:
    model = AttributeClassifier()
    model.load_state_dict(load_file(path))
    return model.eval()
