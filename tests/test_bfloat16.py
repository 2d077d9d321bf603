"""Every family through the three workers in bfloat16, bit-identical to its diffusers pipeline
loaded the same way: the dtype a GPU serves in, checked on the CPU (one thread per op). The
modules a model keeps in float32 (Wan's time embedding, norms and modulation tables) stay so
on both sides; cast to bfloat16 on one side only, they made the two differ by up to 0.0078
in one forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from keys import ImageInput
from tests.test_img2img import picture, stored
from tests.workers_harness import make_spec, model_service, reference, run_request
from workers.families import family_of
from workers.families.base import Placement

pytestmark = pytest.mark.slow
BF16 = Placement.for_settings("cpu", "bfloat16")


def dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in [*module.named_parameters(), *module.named_buffers()]}


@pytest.mark.parametrize("folder", ["model_dir", "i2v_model_dir", "qwen_model_dir",
                                    "edit_model_dir"])
def test_each_family_in_bfloat16_is_its_pipelines(folder: str, tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    directory: Path = request.getfixturevalue(folder)
    family = family_of(directory)
    pipe = family.reference(directory, BF16)
    # The same module dtypes on both sides, float32 ones included where the model keeps any.
    worker = family.denoiser(directory, BF16).transformer
    assert dtypes(pipe.pipe.transformer) == dtypes(worker)
    assert torch.bfloat16 in dtypes(worker).values()
    image: Image.Image | None = picture(5) if family.limits.image_conditions else None
    with model_service(tmp_path, directory, family.name, dtype="bfloat16") as service:
        changes: dict[str, object] = ({} if family.limits.video else
                                      {"num_frames": 1, "negative_prompt": ""})
        if image is not None:
            changes["image"] = ImageInput(stored(service.settings, image, "acme"),
                                          strength=None)
        spec = make_spec(num_inference_steps=3, **changes)
        frames = run_request(service.settings, service.client, spec)
    want = reference(lambda s: pipe(s, image) if image is not None else pipe(s), spec)
    assert np.array_equal(frames, want)
