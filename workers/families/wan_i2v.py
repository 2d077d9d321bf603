"""Wan image-to-video: the Wan family's text encoder, VAE and scheduler, with a DiT that takes
an input image's condition beside its latents at every step.

The condition is what ``WanImageToVideoPipeline.prepare_latents`` builds: the image as the
first frame of an otherwise black video, VAE-encoded (its mode, no sample) and normalised,
after a mask that marks the first frame as given. It depends on the image and the video's
geometry only, so the encode stage computes it once per image and geometry and every step of
every request that animates that image takes it (``image_latent`` kind). The tiny model is
Wan2.1's architecture without the CLIP image encoder (as Wan2.2's image-to-video is); a
checkpoint that needs what this module does not run (a CLIP image embedding, two experts, or
Wan2.2 TI2V's first-frame timesteps) is refused at load, naming the setting.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from keys import Fingerprint, GenerationSpec
from workers.families import wan
from workers.families.base import CPU, Family, Placement, vae_encode_fingerprint
from workers.queue.served_model import FamilyLimits, Workflow


def build(directory: Path, preset_name: str, seed: int = 0) -> None:
    """Build the tiny image-to-video pipeline from ``seed`` and save it."""
    from diffusers import WanImageToVideoPipeline

    # The condition's channels: the first-frame mask (one per pixel frame of a latent frame:
    # the VAE's temporal factor, 4) and the VAE's latent channels (16).
    parts = wan.components(preset_name, seed, condition_channels=4 + 16)
    wan.save_built(directory, parts.pipeline(WanImageToVideoPipeline), preset_name, seed)


class UnsupportedCheckpointError(ValueError):
    """A ``WanImageToVideoPipeline`` folder that takes what this family does not run."""


def check_checkpoint(directory: Path) -> None:
    """Refuse, naming the setting, a checkpoint whose pipeline takes another path than the
    one the stages reproduce: they would give other outputs, silently."""
    index = json.loads((directory / "model_index.json").read_text())
    dit = json.loads((directory / "transformer" / "config.json").read_text())
    for name, value in [("model_index.json boundary_ratio", index.get("boundary_ratio")),
                        ("model_index.json expand_timesteps", index.get("expand_timesteps")),
                        ("transformer image_dim", dit.get("image_dim"))]:
        if value:
            raise UnsupportedCheckpointError(
                f"{directory}: {name} is {value!r}; the wan-i2v family runs Wan image-to-video "
                "without it (no CLIP image embedding, one expert, one timestep per row)")


def condition_fingerprint(directory: Path, placement: Placement) -> Fingerprint:
    """The VAE as it encodes the condition; the pipeline hands it float32 pixels."""
    return vae_encode_fingerprint(directory, placement, torch.float32,
                                  "image-to-video condition")


class WanConditionEncoder:
    """An input image to the condition the DiT takes at every step, as
    ``WanImageToVideoPipeline`` computes it for one video."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        self.device = placement.device
        self.vae = AutoencoderKLWan.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.processor = VideoProcessor(vae_scale_factor=self.vae.config.scale_factor_spatial)
        self.fingerprint = condition_fingerprint(directory, placement)
        self.sized_by_output = True
        self.mask_fingerprint: Fingerprint | None = None  # no inpainting

    def encode_mask(self, mask: Image.Image, width: int, height: int) -> torch.Tensor:
        raise ValueError("an image-to-video model does no inpainting")

    @torch.no_grad()
    def encode(self, image: Image.Image, width: int, height: int, frames: int) -> torch.Tensor:
        """The condition of a video of ``frames`` at ``width`` x ``height`` whose first frame
        is ``image``: (1, mask + latent channels, latent frames, latent height, width)."""
        vae, config = self.vae, self.vae.config
        temporal = config.scale_factor_temporal
        pixels = self.processor.preprocess(image, height=height, width=width).to(
            self.device, dtype=torch.float32).unsqueeze(2)
        video = torch.cat([pixels, pixels.new_zeros(1, pixels.shape[1], frames - 1, height,
                                                    width)], dim=2)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1) \
            .to(latents)
        latents = (latents - mean) * inverse_std
        # The mask of given pixel frames (the first), its first latent frame's entries
        # repeated to the temporal factor, then folded into channels: as the pipeline does.
        *_, latent_h, latent_w = latents.shape
        mask = torch.ones(1, 1, frames, latent_h, latent_w)
        mask[:, :, 1:] = 0
        mask = torch.cat([torch.repeat_interleave(mask[:, :, :1], temporal, dim=2),
                          mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, temporal, latent_h, latent_w).transpose(1, 2)
        return torch.cat([mask.to(latents.device), latents], dim=1).contiguous()


class WanI2VTrajectory(wan.WanTrajectory):
    """Wan's trajectory, named by the encoder of the image that conditions it as well."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        check_checkpoint(directory)
        super().__init__(directory, placement)
        self.image_fingerprint = condition_fingerprint(directory, placement.encoding)


class WanI2VDenoiser(WanI2VTrajectory, wan.WanDenoiser):
    """The Wan DiT with the image's condition concatenated to its latents' channels."""

    def initial_latents(self, spec: GenerationSpec, image: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Generator]:
        """The pipeline's starting noise, as text-to-video draws it: the image is not part
        of it (``image`` is its condition, which each forward takes instead)."""
        if spec.image is None or spec.image.strength is not None:
            raise ValueError(f"request {spec.request_id}: an image-to-video model animates "
                             "an input image from pure noise (an image, and no strength)")
        return self._noise(spec)

    def condition_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        _, _, frames, height, width = self.latent_shape(spec)
        config = self.transformer.config
        return (1, config.in_channels - config.out_channels, frames, height, width)


class WanI2VReference(wan.WanReference):
    """The monolithic ``WanImageToVideoPipeline``: what the three stages must equal."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import WanImageToVideoPipeline

        super().__init__(directory, placement, WanImageToVideoPipeline)

    def __call__(self, spec: GenerationSpec, image: Image.Image | None = None,
                 mask: Image.Image | None = None) -> np.ndarray:
        if spec.image is None or image is None or mask is not None:
            raise ValueError(f"request {spec.request_id}: image-to-video needs its image, "
                             "and no mask")
        return self._frames(spec, {"image": image})


# A request to this model must give an image, which conditions every step.
LIMITS = FamilyLimits(video=True, frame_multiple=4, spatial_multiple=16,
                      max_prompt_tokens=wan.LIMITS.max_prompt_tokens,
                      workflows=frozenset({Workflow.IMAGE_TO_VIDEO}))


FAMILY = Family(name="wan-i2v", pipeline_class="WanImageToVideoPipeline", limits=LIMITS,
                presets=tuple(wan.PRESETS), build=build, text_encoder=wan.WanTextEncoder,
                trajectory=WanI2VTrajectory, denoiser=WanI2VDenoiser, decoder=wan.WanDecoder,
                reference=WanI2VReference, geometry=wan.geometry,
                image_encoder=WanConditionEncoder)
