"""The vectors approximate reuse compares prompts by. The text encoder's mean is any model's;
the denoiser's first step is what a prompt does to a trajectory, which is what a reused
prefix must share: two prompts whose first predictions agree start their images alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch.nn import functional

from encoders.text import MeanPooled, PromptView, unit
from keys import GenerationSpec
from workers.families.base import Denoiser

# The model card's ``reuse_vector`` values.
TEXT_MEAN = MeanPooled.name
FIRST_STEP = "denoiser-first-step"
VIEWS = (TEXT_MEAN, FIRST_STEP)

# A first prediction longer than this is averaged down, in contiguous runs, to this many
# floats: the index holds one vector per request and searches a bucket by scanning part of
# it, so a lookup's cost and a worker's memory grow with the vector (a million of 1,024
# floats: a 5.7 ms p99 and 4 GB a copy). Averaging the shipped shapes model's 1,024 floats
# (16 tokens of 64) down to 256 ranks its prompts as well (README "Which vector").
MAX_FLOATS = 256


class ReuseViewError(ValueError):
    """The model card names a vector this server does not make."""


class FirstStep:
    """The denoiser's first prediction for the prompt, conditional only, from the noise of
    seed 0 at the request's first timestep: the same start for every request of a bucket (one
    shape, steps and scheduler), so what differs is what the prompt does. One forward at
    encode, against the many that a reused prefix saves."""

    name = FIRST_STEP

    def __init__(self, denoiser: Denoiser) -> None:
        self.denoiser = denoiser

    @torch.no_grad()
    def vector(self, embedding: torch.Tensor, positions: int,
               spec: GenerationSpec) -> np.ndarray:
        d = self.denoiser
        start = dataclasses.replace(spec, seed=0)
        latents, _ = d.initial_latents(start)
        first = d.scheduler(start).timesteps[0]
        flat = d.predict(latents, first, embedding.to(d.device), start).flatten().float()
        if flat.numel() > MAX_FLOATS:
            flat = functional.adaptive_avg_pool1d(flat[None, None], MAX_FLOATS)[0, 0]
        return unit(flat)


def prompt_view(name: str, denoiser: Callable[[], Denoiser]) -> PromptView:
    """The view the model card's ``reuse_vector`` names; ``denoiser`` loads the DiT, which
    only the first-step view needs."""
    if name == TEXT_MEAN:
        return MeanPooled()
    if name == FIRST_STEP:
        return FirstStep(denoiser())
    raise ReuseViewError(f"model card: reuse_vector is {name!r}; this server makes "
                         f"{', '.join(VIEWS)}")
