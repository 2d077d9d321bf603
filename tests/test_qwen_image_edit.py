"""Qwen-Image-Edit's first part: the tiny model builds, reads like a real checkpoint's folder,
and its processor (images only, no torchvision) loads back to the same inputs; the
instruction's encoding with its image, the condition latents and the denoiser's steps are
bit-identical to ``QwenImageEditPipeline``'s (CPU, float32, the condition area brought down
to 128x128 pixels in both)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from cachesvc.tensor_cache import TensorCache
from encoders.image import ImageLostError, encode_image
from encoders.text import encode_texts_with_image
from keys import GenerationSpec, ImageInput, KeyKind, image_key
from uploads.images import normalise
from workers.families import qwen_image, qwen_image_edit
from workers.queue.admission import FieldError, TextLimits, check_texts
from workers.queue.submit import new_request_id

AREA = qwen_image_edit.SMALL_CONDITION["test"]  # the test preset's card lowers it
# The pipeline's own, taken before ``small_area_pipe`` patches it for the module's tests.
UNPATCHED: Callable[..., Any] = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module")
def edit_dir(edit_model_dir: Path) -> Path:
    return edit_model_dir


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
    encoder = qwen_image_edit.EditTextEncoder(edit_dir)
    image = picture()
    width, height = qwen_image_edit.condition_size(image, AREA)
    shown = small_area_pipe.image_processor.resize(image, height, width)
    for text in ("make the sky green", " "):
        want, mask = small_area_pipe.encode_prompt(text, image=shown)
        assert mask is None  # one text: no padding
        assert torch.equal(encoder.encode_with_image(text, image), want)
    other = Image.fromarray(np.full((72, 48, 3), 200, dtype=np.uint8))
    assert not torch.equal(encoder.encode_with_image(" ", other),
                           encoder.encode_with_image(" ", image))


def test_the_condition_latents_are_the_pipelines(edit_dir: Path, small_area_pipe: Any) -> None:
    encoder = qwen_image_edit.EditConditionEncoder(edit_dir)
    image = picture()
    width, height = qwen_image_edit.condition_size(image, AREA)
    pixels = small_area_pipe.image_processor.preprocess(
        small_area_pipe.image_processor.resize(image, height, width), height, width).unsqueeze(2)
    _, want = small_area_pipe.prepare_latents(pixels, 1, 16, 64, 64, torch.float32,
                                              torch.device("cpu"), torch.Generator())
    condition = encoder.encode(image, 64, 64, 1)  # whatever the output's size
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
    texts = qwen_image_edit.EditTextEncoder(edit_dir)
    condition = qwen_image_edit.EditConditionEncoder(edit_dir).encode(image, 64, 64, 1)
    denoiser = qwen_image_edit.EditDenoiser(edit_dir)
    cond, uncond = (texts.encode_with_image(text, image) for text in ("make it red", " "))
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


def test_an_instruction_is_encoded_once_per_image_and_needs_the_image_only_to_encode(
        edit_dir: Path, cache: TensorCache) -> None:
    encoder = qwen_image_edit.EditTextEncoder(edit_dir)
    image, other = picture(), Image.fromarray(np.full((72, 48, 3), 90, dtype=np.uint8))
    hashes = [kept(cache, p) for p in (image, other)]

    def edit(content_hash: str) -> GenerationSpec:
        return GenerationSpec.create(
            request_id=new_request_id(), tenant="t", prompt="make it red", width=64, height=64,
            num_frames=1, num_inference_steps=2, guidance_scale=1.0, seed=1,
            image=ImageInput(content_hash, strength=None))

    first = encode_texts_with_image(cache, encoder, edit(hashes[0]), ["make it red"])
    assert not first["make it red"].hit
    assert first["make it red"].key.kind is KeyKind.IMAGE_EMBEDDING
    assert torch.equal(first["make it red"].tensor, encoder.encode_with_image("make it red", image))
    # Read back, though the image is gone from the store: the key needed only its hash.
    assert cache.remove(image_key("t", hashes[0]))
    again = encode_texts_with_image(cache, encoder, edit(hashes[0]), ["make it red"])
    assert again["make it red"].hit
    assert torch.equal(again["make it red"].tensor, first["make it red"].tensor)
    # Another image is another entry, and a lost one with no entry says so.
    assert encode_texts_with_image(cache, encoder, edit(hashes[1]),
                                   ["make it red"])["make it red"].key != first["make it red"].key
    with pytest.raises(ImageLostError, match=hashes[0]):
        encode_texts_with_image(cache, encoder, edit(hashes[0]), ["make it blue"])


def test_an_images_condition_is_encoded_once_whatever_the_output_size(
        edit_dir: Path, cache: TensorCache) -> None:
    """The condition's size is the image's own at the card's area, so its key names no output
    size: the encoding asked at another size is the same, and an edit at that size reads
    it."""
    model = qwen_image_edit.EditConditionEncoder(edit_dir)
    content_hash = kept(cache, picture())

    def edit(width: int, height: int) -> GenerationSpec:
        return GenerationSpec.create(
            request_id=new_request_id(), tenant="t", prompt="make it red", width=width,
            height=height, num_frames=1, num_inference_steps=2, guidance_scale=1.0, seed=1,
            image=ImageInput(content_hash, strength=None))

    first = encode_image(cache, model, edit(64, 64))
    assert torch.equal(first.tensor, model.encode(picture(), 96, 48, 1))
    # Read back at another size, though the image is gone: nothing was encoded again.
    assert cache.remove(image_key("t", content_hash))
    again = encode_image(cache, model, edit(96, 48))
    assert again.key == first.key and torch.equal(again.tensor, first.tensor)


def kept(cache: TensorCache, image: Image.Image) -> str:
    """``image`` in the store as ``POST /v1/images`` keeps it for tenant "t"; its hash."""
    png = io.BytesIO()
    image.save(png, format="PNG")
    normalised = normalise(png.getvalue(), 2**20, 2**20)
    cache.put(image_key("t", normalised.hash),
              torch.frombuffer(bytearray(normalised.png), dtype=torch.uint8))
    return normalised.hash


def test_a_checkpoint_with_zero_cond_t_is_refused_naming_it(edit_dir: Path,
                                                            tmp_path: Path) -> None:
    """Qwen-Image-Edit-2511's condition timesteps are a path the stages do not reproduce:
    such a folder is refused, not served wrongly."""
    qwen_image_edit.EditTrajectory(edit_dir)  # the tiny model has none
    folder = tmp_path / "model"
    shutil.copytree(edit_dir, folder)
    config_path = folder / "transformer" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"zero_cond_t": True}))
    for load in (qwen_image_edit.EditTrajectory, qwen_image_edit.EditDenoiser):
        with pytest.raises(qwen_image_edit.UnsupportedCheckpointError, match="zero_cond_t"):
            load(folder)


def test_a_prompt_holding_the_templates_image_marker_is_refused_naming_it(
        edit_dir: Path) -> None:
    # At admission, by the family's published limits, naming the field that holds it ...
    limits = TextLimits(1000, 1000, len, qwen_image_edit.LIMITS.reserved_texts)
    check_texts((("prompt", "make the fox red"), ("negative_prompt", "blurry")), limits)
    with pytest.raises(FieldError, match=r"<\|vision_end\|>") as refused:
        check_texts((("prompt", "make the fox red"), ("negative_prompt", "a<|vision_end|>")),
                    limits)
    assert refused.value.field == "negative_prompt"
    # ... and by the encoder, should a text reach it some other way.
    encoder = qwen_image_edit.EditTextEncoder(edit_dir)
    with pytest.raises(ValueError, match=r"<\|image_pad\|>"):
        encoder.encode_with_image("a fox <|image_pad|> in snow", picture())
