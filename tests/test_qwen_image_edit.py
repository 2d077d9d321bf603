"""Qwen-Image-Edit's first part: the tiny model builds, reads like a real checkpoint's folder,
and its processor (images only, no torchvision) loads back to the same inputs; the
instruction's encoding with its image, the condition latents and the denoiser's steps are
bit-identical to ``QwenImageEditPipeline``'s (CPU, float32, the condition area brought down
to 128x128 pixels in both)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from keys import GenerationSpec, ImageInput
from workers.families import qwen_image, qwen_image_edit
from workers.queue.submit import new_request_id

AREA = 128 * 128  # the condition's pixels: the pipeline's megapixel would cost seconds a step
# The pipeline's own, taken before ``small_area_pipe`` patches it for the module's tests.
UNPATCHED: Callable[..., Any] = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-edit")
    qwen_image_edit.build(directory, "test", seed=0)
    return directory


@pytest.fixture(scope="module")
def small_area_pipe(edit_dir: Path) -> Iterator[Any]:
    """The folder's pipeline with its condition area brought down to ``AREA``."""
    with mock.patch.object(pipeline_qwenimage_edit, "calculate_dimensions",
                           lambda _, ratio: UNPATCHED(AREA, ratio)):
        yield qwen_image_edit.load_pipeline(edit_dir)


def picture() -> Image.Image:
    pixels = np.random.default_rng(5).integers(0, 256, (72, 48, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_the_folder_names_the_real_processor_and_loads_images_only(edit_dir: Path) -> None:
    index = json.loads((edit_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    processor = qwen_image_edit.load_processor(edit_dir)
    assert type(processor).__name__ == "EditProcessor"
    prefix = qwen_image.template_prefix(qwen_image_edit.EDIT_TEMPLATE)
    assert len(processor.tokenizer(prefix).input_ids) == qwen_image_edit.EDIT_DROP_IDX


def test_the_loaded_processor_gives_what_the_built_one_gave(edit_dir: Path) -> None:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    loaded = qwen_image_edit.load_processor(edit_dir)
    built = qwen_image_edit.processor_class()(
        image_processor=Qwen2VLImageProcessorPil(**qwen_image_edit.PROCESSOR_CONFIG),
        tokenizer=loaded.tokenizer)
    text = [qwen_image_edit.EDIT_TEMPLATE.format("make the sky green")]
    one, two = (p(text=text, images=picture(), padding=True, return_tensors="pt")
                for p in (loaded, built))
    assert set(one) == set(two)
    for name in one:
        assert torch.equal(one[name], two[name]), name
    # The image is in the prompt: its tokens, expanded from the template's one placeholder.
    pad = loaded.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((one["input_ids"] == pad).sum()) > 1


def test_the_pipeline_edits_offline_the_same_way_twice(small_area_pipe: Any) -> None:
    def edited(prompt: str) -> np.ndarray:
        out = small_area_pipe(image=picture(), prompt=prompt, negative_prompt=" ",
                              true_cfg_scale=4.0, height=64, width=64, num_inference_steps=2,
                              generator=torch.Generator().manual_seed(1), output_type="np")
        return np.asarray(out.images)

    first = edited("make it red")
    assert first.shape == (1, 64, 64, 3)
    assert np.array_equal(first, edited("make it red"))
    assert not np.array_equal(first, edited("make it blue"))




def test_the_condition_size_is_the_pipelines() -> None:
    for width, height in [(48, 72), (1000, 10), (640, 480), (33, 33)]:
        for area in (AREA, qwen_image_edit.CONDITION_AREA):
            want = UNPATCHED(area, width / height)[:2]
            assert qwen_image_edit.condition_size(Image.new("RGB", (width, height)),
                                                  area) == want


def test_the_instruction_and_its_image_encode_as_the_pipeline_encodes_them(
        edit_dir: Path, small_area_pipe: Any) -> None:
    encoder = qwen_image_edit.EditTextEncoder(edit_dir, area=AREA)
    image = picture()
    width, height = qwen_image_edit.condition_size(image, AREA)
    shown = small_area_pipe.image_processor.resize(image, height, width)
    for text in ("make the sky green", " "):
        want, mask = small_area_pipe.encode_prompt(text, image=shown)
        assert mask is None  # one text: no padding
        assert torch.equal(encoder.encode(text, image), want)
    other = Image.fromarray(np.full((72, 48, 3), 200, dtype=np.uint8))
    assert not torch.equal(encoder.encode(" ", other), encoder.encode(" ", image))


def test_the_condition_latents_are_the_pipelines(edit_dir: Path, small_area_pipe: Any) -> None:
    encoder = qwen_image_edit.EditConditionEncoder(edit_dir, area=AREA)
    image = picture()
    width, height = qwen_image_edit.condition_size(image, AREA)
    pixels = small_area_pipe.image_processor.preprocess(
        small_area_pipe.image_processor.resize(image, height, width), height, width).unsqueeze(2)
    _, want = small_area_pipe.prepare_latents(pixels, 1, 16, 64, 64, torch.float32,
                                              torch.device("cpu"), torch.Generator())
    condition = encoder.encode(image)
    assert condition.shape == (1, 16, 1, height // 8, width // 8)
    assert torch.equal(qwen_image.pack_latents(condition[:, :, 0]), want)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_the_denoiser_steps_as_the_pipeline_does(edit_dir: Path, small_area_pipe: Any,
                                                 guidance: float) -> None:
    """The family's pieces in a plain loop (the three stages' work, in one place): the same
    latents as the pipeline's, with true CFG and without."""
    image, steps = picture(), 3
    spec = GenerationSpec.create(
        request_id=new_request_id(), tenant="t", prompt="make it red", negative_prompt=" ",
        width=64, height=64, num_frames=1, num_inference_steps=steps,
        guidance_scale=guidance, seed=9, image=ImageInput("0" * 32, strength=None))
    texts = qwen_image_edit.EditTextEncoder(edit_dir, area=AREA)
    condition = qwen_image_edit.EditConditionEncoder(edit_dir, area=AREA).encode(image)
    denoiser = qwen_image_edit.EditDenoiser(edit_dir)
    cond, uncond = texts.encode("make it red", image), texts.encode(" ", image)
    latents, _ = denoiser.initial_latents(spec)
    scheduler = denoiser.scheduler(spec)
    for t in scheduler.timesteps:
        noise = denoiser.predict(latents, t, cond, spec, condition=condition)
        if guidance > 1:
            noise = denoiser.guide(noise, denoiser.predict(latents, t, uncond, spec,
                                                           condition=condition), guidance)
        latents = scheduler.step(noise, t, latents, return_dict=False)[0]

    want = small_area_pipe(image=image, prompt="make it red", negative_prompt=" ",
                           true_cfg_scale=guidance, height=64, width=64,
                           num_inference_steps=steps, output_type="latent",
                           generator=torch.Generator().manual_seed(9)).images
    assert torch.equal(latents, want)
