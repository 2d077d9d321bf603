"""Qwen-Image-Edit (instruction editing), its first part: the tiny model's build, the
processor that loads without torchvision, and the three pieces that differ from Qwen-Image
(the instruction encoded with its image, the condition image's latents, the DiT with the
condition in its sequence), each bit-identical to ``QwenImageEditPipeline`` on the CPU in
float32. Not served yet: nothing here is registered in ``workers.families``; the cache kind
of the image-conditioned embedding, the engine's token count and the routes are to come.

``QwenImageEditPipeline`` takes a ``Qwen2VLProcessor``; transformers builds that one only with
a video processor, which needs torchvision (a CUDA build on this index, which does not import
against the CPU torch). ``EditProcessor`` is the same processor for images only, saved and
loaded like it; a pipeline must be given it explicitly (``processor=``).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from keys import GenerationSpec
from workers.families import qwen_image
from workers.families.base import CPU, Placement, check_condition

# QwenImageEditPipeline's prompt template: the image's tokens sit in the user's turn, and the
# first EDIT_DROP_IDX tokens (all before them) are dropped from the hidden states.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should "
    "alter or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
EDIT_DROP_IDX = 64
# The pixels the pipeline brings every condition image to, whatever the output's size (a
# literal in its ``__call__``); tiny test models take less, and their reference patches it.
CONDITION_AREA = 1024 * 1024
# The tiny model's image processor: patches of the vision config's size, and an image of at
# most 112x112 pixels, so the prompt carries at most 16 merged image tokens at any size.
PROCESSOR_CONFIG: dict[str, Any] = {"patch_size": 14, "merge_size": 2,
                                    "temporal_patch_size": 2, "min_pixels": 56 * 56,
                                    "max_pixels": 112 * 112}


@functools.cache
def processor_class() -> Any:
    """``EditProcessor``: ``Qwen2VLProcessor`` with no video processor (its signature names
    the image processor and the tokenizer only, which is what it saves and loads)."""
    from transformers import Qwen2VLProcessor

    class EditProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    return EditProcessor


def load_processor(directory: Path) -> Any:
    """The model folder's processor, loaded as ``EditProcessor``."""
    return processor_class().from_pretrained(directory / "processor")


def build(directory: Path, preset_name: str, seed: int = 0) -> None:
    """A tiny random ``QwenImageEditPipeline`` of the Qwen-Image preset's sizes, saved so that
    its folder reads like a real checkpoint's (its processor named ``Qwen2VLProcessor``)."""
    from diffusers import QwenImageEditPipeline
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    parts = qwen_image.untrained_components(qwen_image.PRESETS[preset_name], seed,
                                            EDIT_TEMPLATE, EDIT_DROP_IDX)
    processor = processor_class()(image_processor=Qwen2VLImageProcessorPil(**PROCESSOR_CONFIG),
                                  tokenizer=parts["tokenizer"])
    pipe: Any = QwenImageEditPipeline(**parts, processor=processor)
    if (pipe.prompt_template_encode != EDIT_TEMPLATE
            or pipe.prompt_template_encode_start_idx != EDIT_DROP_IDX):
        raise RuntimeError("QwenImageEditPipeline's prompt template changed; update this "
                           "family")
    pipe.save_pretrained(directory)
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def load_pipeline(directory: Path) -> Any:
    """The folder's ``QwenImageEditPipeline``, its processor given explicitly."""
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(directory, processor=load_processor(directory))


def condition_size(image: Image.Image, area: int = CONDITION_AREA) -> tuple[int, int]:
    """(width, height) the pipeline brings ``image`` to, for the VAE and the vision tower
    alike: its aspect at about ``area`` pixels, each side rounded to a multiple of 32 (its
    ``calculate_dimensions``)."""
    ratio = image.width / image.height
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


class EditTextEncoder:
    """The instruction's conditioning as ``QwenImageEditPipeline.encode_prompt`` computes it
    for one text and its image: the image resized to the condition size, the template with
    the image's tokens, the last hidden state from the image's tokens on (never cut)."""

    def __init__(self, directory: Path, placement: Placement = CPU,
                 area: int = CONDITION_AREA) -> None:
        from diffusers.image_processor import VaeImageProcessor
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.device = placement.device
        self.area = area
        self.processor = load_processor(directory)
        model: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            directory / "text_encoder", dtype=placement.text_dtype)
        self.model = model.to(self.device).eval()
        # The pipeline's image processor, for its resize only (Lanczos, as PIL does it).
        self.resizer = VaeImageProcessor(vae_scale_factor=16)

    @torch.no_grad()
    def encode(self, text: str, image: Image.Image) -> torch.Tensor:
        width, height = condition_size(image, self.area)
        shown = self.resizer.resize(image, height, width)
        inputs = self.processor(text=[EDIT_TEMPLATE.format(text)], images=shown, padding=True,
                                return_tensors="pt").to(self.device)
        # Exactly the pipeline's four inputs: the processor's ``mm_token_type_ids`` would
        # change the positions the language model gives the image's tokens.
        hidden = self.model(input_ids=inputs["input_ids"],
                            attention_mask=inputs["attention_mask"],
                            pixel_values=inputs["pixel_values"],
                            image_grid_thw=inputs["image_grid_thw"],
                            output_hidden_states=True).hidden_states[-1]
        selected = hidden[inputs["attention_mask"].bool()][EDIT_DROP_IDX:]
        return selected.unsqueeze(0).to(self.model.dtype).contiguous()


class EditConditionEncoder:
    """The condition image's latents as ``QwenImageEditPipeline.prepare_latents`` makes them:
    resized to the condition size, encoded to the distribution's mode (no draw from the
    generator), normalised by the VAE's mean and spread. Kept unpacked, (1, C, 1, h, w), so
    its grid stays readable."""

    def __init__(self, directory: Path, placement: Placement = CPU,
                 area: int = CONDITION_AREA) -> None:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        self.device = placement.device
        self.dtype = placement.text_dtype
        self.area = area
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.processor = VaeImageProcessor(
            vae_scale_factor=2 ** len(self.vae.temperal_downsample) * 2)

    @torch.no_grad()
    def encode(self, image: Image.Image) -> torch.Tensor:
        width, height = condition_size(image, self.area)
        shown = self.processor.resize(image, height, width)
        pixels = self.processor.preprocess(shown, height, width).unsqueeze(2)
        latents = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)
        normalised: torch.Tensor = (latents - mean.to(latents)) / std.to(latents)
        return normalised.contiguous()


class EditDenoiser(qwen_image.QwenDenoiser):
    """The Qwen-Image DiT with the condition image's latents after the output's in its
    sequence at every step (their own grid in its positions), only the output's part of the
    prediction kept. The trajectory starts from noise, as text-to-image's does; the image
    draws nothing from the seed."""

    def initial_latents(self, spec: GenerationSpec, image: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Generator]:
        if spec.image is None or spec.image.strength is not None:
            raise ValueError(f"request {spec.request_id}: an edit takes an image, and no "
                             "strength")
        return self.pure_noise(spec)

    @torch.no_grad()
    def predict(self, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                spec: GenerationSpec, text_mask: torch.Tensor | None = None,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        check_condition(spec, condition, takes=True)
        assert condition is not None
        rows = latents.shape[0]
        packed = qwen_image.pack_latents(condition[:, :, 0]).to(latents)
        packed = packed.expand(rows, -1, -1) if packed.shape[0] != rows else packed
        grid = (1, condition.shape[-2] // 2, condition.shape[-1] // 2)
        out = self.transformer(hidden_states=torch.cat([latents, packed], dim=1),
                               timestep=t.expand(rows).to(latents.dtype) / 1000,
                               guidance=None, encoder_hidden_states_mask=text_mask,
                               encoder_hidden_states=embeds.to(self.device),
                               img_shapes=[[(1, *self.tokens_per_side(spec)), grid]] * rows,
                               attention_kwargs={}, return_dict=False)[0]
        return out[:, :latents.shape[1]]
