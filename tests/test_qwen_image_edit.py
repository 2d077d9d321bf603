"""Qwen-Image-Edit groundwork: the tiny model builds, reads like a real checkpoint's folder,
and its processor (images only, no torchvision) loads back to the same inputs; the pipeline
runs on it offline, deterministically."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from workers.families import qwen_image, qwen_image_edit


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-edit")
    qwen_image_edit.build(directory, "test", seed=0)
    return directory


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


def test_the_pipeline_edits_offline_the_same_way_twice(edit_dir: Path) -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    pipe = qwen_image_edit.load_pipeline(edit_dir)
    original: Callable[..., Any] = module.calculate_dimensions

    def edited(prompt: str) -> np.ndarray:
        # The pipeline brings the condition to about a megapixel; a small area keeps it cheap.
        with mock.patch.object(module, "calculate_dimensions",
                               lambda _, ratio: original(128 * 128, ratio)):
            out = pipe(image=picture(), prompt=prompt, negative_prompt=" ",
                       true_cfg_scale=4.0, height=64, width=64, num_inference_steps=2,
                       generator=torch.Generator().manual_seed(1), output_type="np")
        return np.asarray(out.images)

    first = edited("make it red")
    assert first.shape == (1, 64, 64, 3)
    assert np.array_equal(first, edited("make it red"))
    assert not np.array_equal(first, edited("make it blue"))
