"""Cancel and preemption act between transformer blocks: a forward stops at the next block
once the job should stop, and hooks that are not watching change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers_harness import make_spec
from workers.engine.interrupt import BlockInterrupts, StepInterrupted
from workers.families import family_named


@pytest.mark.slow  # builds the test models: seconds
@pytest.mark.parametrize("family", ["wan", "qwen-image"])
def test_a_forward_stops_at_the_next_block_and_unwatched_hooks_change_nothing(
        family: str, model_dir: Path, qwen_model_dir: Path) -> None:
    directory = model_dir if family == "wan" else qwen_model_dir
    denoiser = family_named(family).denoiser(directory)
    text = family_named(family).text_encoder(directory)
    spec = make_spec(num_frames=1 if family == "qwen-image" else 5)
    embeds = text.encode(text.tokenize("a red fox"))
    latents, _ = denoiser.initial_latents(spec)
    t = denoiser.scheduler(spec).timesteps[0]
    expected = denoiser.predict(latents, t, embeds, spec)  # before any hook exists

    interrupts = BlockInterrupts(denoiser.transformer)
    assert len(interrupts.blocks) == denoiser.transformer.config.num_layers
    asked: list[int] = []

    def after_the_first_block() -> bool:
        asked.append(1)
        return len(asked) > 1

    with interrupts.watching(after_the_first_block), pytest.raises(StepInterrupted):
        denoiser.predict(latents, t, embeds, spec)
    assert len(asked) == 2  # the first block ran; the second never started
    assert torch.equal(denoiser.predict(latents, t, embeds, spec), expected)
