"""The Qwen-Image-Edit family (instruction editing): Qwen-Image's DiT, VAE and scheduler, with
the instruction read by the vision-language text encoder together with the image it edits,
and the image's latents after the output's in the DiT's sequence at every step.

The image is brought to about a megapixel whatever the output's size (``CONDITION_AREA``; a
model card's ``condition_area`` lowers it for tiny test models), for the VAE and the vision
tower alike. The stage code reproduces ``QwenImageEditPipeline`` (diffusers 0.42) step for
step; the instruction's embedding is its own cache kind (``image_embed``), keyed by the text's
tokens and the image's hash, and the condition latents an ``image_latent`` entry.

``QwenImageEditPipeline`` takes a ``Qwen2VLProcessor``; transformers builds that one only with
a video processor, which needs torchvision (a CUDA build on this index, which does not import
against the CPU torch). ``EditProcessor`` is the same processor for images only, saved and
loaded like it; a pipeline must be given it explicitly (``processor=``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from PIL import Image

from keys import Fingerprint, GenerationSpec, digest
from workers.families import qwen_image
from workers.families.base import (
    CPU,
    Family,
    Placement,
    check_condition,
    component_fingerprint,
    placed_pipeline,
    to_uint8,
    vae_encode_fingerprint,
)
from workers.families.step_cache import hook_config, hooks_enabled
from workers.queue.served_model import (
    MODEL_CARD,
    FamilyLimits,
    Workflow,
    model_card,
    size_at_area,
)

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
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# The pixels the pipeline brings every condition image to, whatever the output's size (a
# literal in its ``__call__``); tiny test models take less, and their reference patches it.
CONDITION_AREA = 1024 * 1024
# What its ``calculate_dimensions`` rounds each side of that image to.
CONDITION_MULTIPLE = 32
# The presets whose card lowers it: the test one, so that a test's forward is not 4,096
# tokens longer; the default one to its outputs' 96x96, so that, as on the real model at 1 MP,
# the condition is as long as the output.
SMALL_CONDITION = {"test": 128 * 128, "default": 96 * 96}
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
    if preset_name in SMALL_CONDITION:
        (directory / MODEL_CARD).write_text(json.dumps(
            {"model": {"condition_area": SMALL_CONDITION[preset_name]}}, indent=2) + "\n")
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def load_pipeline(directory: Path) -> Any:
    """The folder's ``QwenImageEditPipeline``, its processor given explicitly."""
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(directory, processor=load_processor(directory))


def condition_area(directory: Path) -> int:
    """The pixels the folder's model brings a condition image to."""
    return model_card(directory).condition_area or CONDITION_AREA


def condition_fingerprint(directory: Path, placement: Placement) -> Fingerprint:
    """The VAE as it makes the condition latents: the mode of the image's distribution at the
    condition size, normalised by the VAE's mean and spread."""
    return vae_encode_fingerprint(
        directory, placement, placement.text_dtype,
        f"edit condition: mode, (x - mean) / std, {condition_area(directory)} pixels")


def condition_size(image: Image.Image, area: int = CONDITION_AREA) -> tuple[int, int]:
    """(width, height) the pipeline brings ``image`` to, for the VAE and the vision tower
    alike: its aspect at about ``area`` pixels, each side rounded to a multiple of 32 (its
    ``calculate_dimensions``)."""
    return size_at_area(image.width, image.height, area, CONDITION_MULTIPLE)


class EditTextEncoder:
    """The instruction's conditioning as ``QwenImageEditPipeline.encode_prompt`` computes it
    for one text and its image: the image resized to the condition size, the template with
    the image's tokens, the last hidden state from the image's tokens on (never cut)."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers.image_processor import VaeImageProcessor
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.device = placement.device
        self.area = area = condition_area(directory)
        self.processor = load_processor(directory)
        model: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            directory / "text_encoder", dtype=placement.text_dtype)
        self.model = model.to(self.device).eval()
        # The pipeline's image processor, for its resize only (Lanczos, as PIL does it).
        self.resizer = VaeImageProcessor(vae_scale_factor=16)
        weights = component_fingerprint(directory, "text_encoder", self.model.dtype,
                                        self.device)
        image_processing = self.processor.image_processor.to_dict()
        image_processing.pop("processor_class", None)
        self.fingerprint = Fingerprint("edit-text", digest("edit-text", {
            "encoder": weights.hex, "template": EDIT_TEMPLATE, "drop": EDIT_DROP_IDX,
            "area": area, "resize": "lanczos", "image_processor": json.dumps(
                image_processing, sort_keys=True, default=str)}))

    def tokenize(self, text: str) -> qwen_image.QwenTokens:
        """The text in the template, the image's place its one placeholder (the processor
        expands it to the image's tokens when it encodes)."""
        out = self.processor.tokenizer([EDIT_TEMPLATE.format(text)], return_tensors="pt")
        return qwen_image.QwenTokens(tuple(out.input_ids[0].tolist()),
                                     tuple(out.attention_mask[0].tolist()))

    @torch.no_grad()
    def encode_with_image(self, text: str, image: Image.Image) -> torch.Tensor:
        for token in VISION_TOKENS:
            if token in text:  # the processor would give the one image's tokens twice
                raise ValueError(f"the prompt holds {token}, which marks the image's place in "
                                 "the template; leave it out")
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

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        placement = qwen_image.in_model_dtype(placement)
        self.device = placement.device
        self.dtype = placement.text_dtype
        self.area = condition_area(directory)
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.processor = VaeImageProcessor(
            vae_scale_factor=2 ** len(self.vae.temperal_downsample) * 2)
        self.fingerprint = condition_fingerprint(directory, placement)
        self.sized_by_output = False  # the condition's size is the image's, at the area
        self.mask_fingerprint: Fingerprint | None = None  # an edit takes no mask

    @torch.no_grad()
    def encode(self, image: Image.Image, width: int, height: int, frames: int) -> torch.Tensor:
        """The condition of ``image`` (by its own aspect, whatever the output's
        ``width`` x ``height``)."""
        width, height = condition_size(image, self.area)
        shown = self.processor.resize(image, height, width)
        pixels = self.processor.preprocess(shown, height, width).unsqueeze(2)
        # Rounded through the prompt's dtype, as the pipeline casts them, then in the VAE's.
        pixels = pixels.to(self.device, self.dtype).to(self.vae.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)
        normalised: torch.Tensor = (latents - mean.to(latents)) / std.to(latents)
        return normalised.contiguous()

    def encode_mask(self, mask: Image.Image, width: int, height: int) -> torch.Tensor:
        raise ValueError("an edit takes no mask")


class UnsupportedCheckpointError(ValueError):
    """A ``QwenImageEditPipeline`` folder that takes what this family does not run."""


def check_checkpoint(directory: Path) -> None:
    """Refuse, naming the setting, a checkpoint whose transformer takes another path than the
    one the stages reproduce: Qwen-Image-Edit-2511's ``zero_cond_t`` gives the condition's
    tokens a timestep of their own (the batch doubled inside the model), which the engine's
    exact rows were never proven on."""
    dit = json.loads((directory / "transformer" / "config.json").read_text())
    if dit.get("zero_cond_t"):
        raise UnsupportedCheckpointError(
            f"{directory}: transformer zero_cond_t is {dit['zero_cond_t']!r}; the "
            "qwen-image-edit family runs Qwen-Image-Edit without it")


class EditTrajectory(qwen_image.QwenTrajectory):
    """Qwen-Image's scheduler (its shift from the output's tokens only, as the pipeline's);
    the chain names the condition latents' encoder."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        placement = qwen_image.in_model_dtype(placement)
        check_checkpoint(directory)
        super().__init__(directory, placement)
        self.image_fingerprint = condition_fingerprint(directory, placement.encoding)


class EditDenoiser(qwen_image.QwenDenoiser, EditTrajectory):
    """The Qwen-Image DiT with the condition image's latents after the output's in its
    sequence at every step (their own grid in its positions), only the output's part of the
    prediction kept. The trajectory starts from noise, as text-to-image's does; the image
    draws nothing from the seed. (``QwenDenoiser`` starts ``EditTrajectory`` first: the
    checkpoint is checked before the DiT loads.)"""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        super().__init__(directory, placement)
        self.area = condition_area(directory)

    def condition_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        """An image of the output's aspect (the warm-up's stand-in: a request's own grid is
        its image's)."""
        width, height = size_at_area(spec.width, spec.height, self.area, CONDITION_MULTIPLE)
        f = self.vae_scale_factor
        return (1, self.transformer.config.in_channels // 4, 1, height // f, width // f)

    def tokens(self, spec: GenerationSpec, condition: tuple[int, ...] | None = None) -> int:
        own = super().tokens(spec)
        return own if condition is None else own + (condition[-2] // 2) * (condition[-1] // 2)

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
                               encoder_hidden_states=embeds.to(self.device,
                                                               self.transformer.dtype),
                               img_shapes=[[(1, *self.tokens_per_side(spec)), grid]] * rows,
                               attention_kwargs={}, return_dict=False)[0]
        return out[:, :latents.shape[1]]


class EditReference:
    """The monolithic ``QwenImageEditPipeline``, its processor given, its condition area the
    card's (for a tiny model's lower one, the pipeline's ``calculate_dimensions`` is patched
    while it runs: a process-wide patch, for tests and benchmarks)."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import QwenImageEditPipeline

        placement = qwen_image.in_model_dtype(placement)
        self.pipe = placed_pipeline(QwenImageEditPipeline, directory, placement,
                                    processor=load_processor(directory))
        self.area = condition_area(directory)
        self.mag_ratios = model_card(directory).magcache_ratios

    def __call__(self, spec: GenerationSpec, image: Image.Image | None = None,
                 mask: Image.Image | None = None) -> np.ndarray:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

        if spec.image is None or image is None or mask is not None:
            raise ValueError(f"request {spec.request_id}: an edit needs its image, and no "
                             "mask")
        segment = spec.schedule[0]
        config = (hook_config(spec.step_cache, spec.num_inference_steps,
                              mag_ratios=self.mag_ratios) if spec.step_cache.on else None)
        area, pipelines = self.area, module.calculate_dimensions  # its own rule, at the area
        with (mock.patch.object(module, "calculate_dimensions",
                                lambda _, ratio: pipelines(area, ratio)),
              hooks_enabled(self.pipe.transformer, config)):
            images = self.pipe(
                image=image, prompt=segment.prompt, negative_prompt=segment.negative_prompt,
                true_cfg_scale=spec.guidance_scale, height=spec.height, width=spec.width,
                num_inference_steps=spec.num_inference_steps, output_type="np",
                generator=torch.Generator().manual_seed(spec.seed)).images
        return to_uint8(images)


# The pipeline cuts no instruction; Qwen-Image's limit keeps the text's part of the sequence
# as long as a text-to-image prompt's at most.
LIMITS = FamilyLimits(video=False, frame_multiple=1, spatial_multiple=16,
                      max_prompt_tokens=qwen_image.LIMITS.max_prompt_tokens,
                      workflows=frozenset({Workflow.INSTRUCTION_EDIT}),
                      condition_area=CONDITION_AREA, condition_multiple=CONDITION_MULTIPLE,
                      reserved_texts=VISION_TOKENS)


FAMILY = Family(name="qwen-image-edit", pipeline_class="QwenImageEditPipeline",
                limits=LIMITS, presets=("default", "test"), build=build,
                text_encoder=EditTextEncoder, trajectory=EditTrajectory,
                denoiser=EditDenoiser, decoder=qwen_image.QwenDecoder, reference=EditReference,
                geometry=qwen_image.geometry, image_encoder=EditConditionEncoder)
