"""The interface every model family implements: the stages know a family only through it.

A family holds everything model-specific: how a text becomes conditioning, the scheduler for
a request and its resumable state, the latents and their noise (or an input image's encoding,
for a family that takes one), how the two CFG branches combine, and the decoder. A new family
is one module: a registry entry, or a plug-in the settings name (``workers.families``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from encoders.image import ImageModel
from encoders.text import ImageTextModel
from encoders.text import TextModel as TextEncoder
from encoders.text import TokenizedText as Tokens
from keys import (
    Fingerprint,
    GenerationSpec,
    StepCache,
    digest,
    file_digest,
    model_fingerprint,
)
from keys.canonical import Canonical
from workers.families.scheduler_state import SchedulerFields
from workers.queue.served_model import FamilyLimits, ModelGeometry

__all__ = ["CPU", "Decoder", "Denoiser", "Family", "ImageModel", "Inpainting", "Placement",
           "PlacementError", "Reference", "TextEncoder", "Tokens", "Trainable", "Trajectory",
           "component_fingerprint", "to_uint8"]


class PlacementError(ValueError):
    """The settings ask for a device this machine does not have."""


def resolve_device(name: str, setting: str = "model.device", checked: bool = True
                   ) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device of this machine. ``checked``: this
    process computes on it, so it must exist here; unchecked, it only names where another
    process computes (an encode worker naming the denoise workers' device in its keys)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if checked and device.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(f"{setting} is {name}, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise PlacementError(f"{setting} is {name}, but torch sees "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
    return device


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each component runs and in which dtype. ``device`` and the DiT's and VAE's dtypes
    are the serving placement (denoise and decode), which every trajectory and output key
    names; ``encoders`` is where the text and image encoders run when that is elsewhere (an
    encode pool on CPU beside GPU denoise workers), which their own keys name."""

    device: torch.device
    dit_dtype: torch.dtype
    text_dtype: torch.dtype
    vae_dtype: torch.dtype
    encoders: Placement | None = None
    # How a denoise worker splits the DiT's forwards over its ranks ("": one rank, else
    # ``ParallelLayout.name``). Keys name it: a forward's bits may depend on the split.
    dit_split: str = ""

    @property
    def encoding(self) -> Placement:
        """Where the encoders run."""
        return self.encoders or self

    @classmethod
    def for_settings(cls, device: str, dtype: str, encode_device: str = "same",
                     computes: str = "all", dit_split: str = "") -> Placement:
        """``model.device``, ``model.dtype`` and ``model.encode_device`` resolved on this
        machine. ``computes`` says which side this process runs (``all``, ``serving`` or
        ``encoders``): only that side's device must exist here, the other is named only.
        ``dit_split``: how the denoise workers split their forwards (``dit_split`` above)."""
        here = resolve_device(device, checked=computes in ("all", "serving"))
        serving = dataclasses.replace(cls._on(here, dtype), dit_split=dit_split)
        if encode_device == "same":
            return serving
        there = resolve_device(encode_device, "model.encode_device",
                               checked=computes in ("all", "encoders"))
        return dataclasses.replace(serving, encoders=cls._on(there, dtype))

    @classmethod
    def _on(cls, device: torch.device, dtype: str) -> Placement:
        """``dtype`` on ``device``: ``auto`` is bfloat16 on CUDA and float32 on the CPU, as the
        reference pipelines run; the VAE in float32 (a family whose pipelines run it in the
        model's dtype says so: Qwen-Image's ``in_model_dtype``)."""
        cuda = device.type == "cuda"
        chosen = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
                  "bfloat16": torch.bfloat16}[dtype]
        return cls(device, chosen, chosen, torch.float32)


CPU = Placement(torch.device("cpu"), torch.float32, torch.float32, torch.float32)


class Trajectory(Protocol):
    """What names a request's trajectory and output, without loading any weights."""

    device: torch.device
    fingerprint: Fingerprint
    decoder_fingerprint: Fingerprint
    # What encodes an input image (``ImageModel.fingerprint``): where image-to-image starts
    # from, or the condition image-to-video takes; the chain root holds it. None for a family
    # that takes no image.
    image_fingerprint: Fingerprint | None
    # MagCache's ratios from the model's card (none: it cannot run MagCache); they decide a
    # MagCache trajectory's skips, so its keys hold them.
    mag_ratios: tuple[float, ...]

    # What its scheduler keeps between steps, which a checkpoint holds.
    scheduler_fields: SchedulerFields

    @property
    def scheduler_config(self) -> Mapping[str, Canonical]:
        """The scheduler's configuration: part of every trajectory's hash chain."""

    def scheduler(self, spec: GenerationSpec) -> Any:
        """A fresh scheduler with the request's timesteps set, at step 0."""


class Inpainting(Protocol):
    """What each step of an inpainting request keeps of its input image."""

    def keep(self, latents: torch.Tensor, scheduler: Any, step: int) -> torch.Tensor:
        """``latents`` just after step ``step`` (``scheduler`` has taken it), with what the
        mask keeps put back to the input image as it stands at the next step."""
        ...


class Denoiser(Trajectory, Protocol):
    """The DiT, driven one step at a time by the denoise worker."""

    transformer: torch.nn.Module  # its ModuleLists of blocks can be interrupted
    # Whether texts of different lengths may share a forward, padded to the longest under a
    # key mask (``predict``'s ``text_mask``); the engine runs the masked attention row by row.
    pads_text: bool

    def latent_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        """The shape of one request's latents, batch dimension included."""

    def initial_latents(self, spec: GenerationSpec, image: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Generator]:
        """The latents at ``spec.first_step`` and the generator they came from: the
        pipeline's starting noise, or for image-to-image the input ``image``'s encoding
        (``ImageModel.encode``) sampled and noised to the first step's timestep."""

    def inpainting(self, spec: GenerationSpec, image: torch.Tensor,
                   mask: torch.Tensor) -> Inpainting:
        """What every step of ``spec`` keeps of its input image (``image``: its encoding;
        ``mask``: ``ImageModel.encode_mask``'s), for a request with a mask; ValueError for a
        family that does no inpainting."""

    def condition_shape(self, spec: GenerationSpec) -> tuple[int, ...] | None:
        """The shape of the image condition every forward of ``spec`` takes beside its
        latents (image-to-video: ``ImageModel.encode``'s output; for instruction editing,
        whose condition's grid is its image's, that of an image of the output's aspect), or
        None where the family takes none; the input image then only starts the trajectory,
        if anything."""

    def tokens(self, spec: GenerationSpec, condition: tuple[int, ...] | None = None) -> int:
        """The image tokens one row of ``spec`` puts through the transformer, its image
        condition of shape ``condition`` included where the family puts that in the
        sequence (the text is told apart from them by its length)."""

    def text_shape(self) -> tuple[int, int]:
        """(tokens, width) of a typical prompt's embeddings: the text a warm-up's rows carry."""

    def predict(self, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                spec: GenerationSpec, text_mask: torch.Tensor | None = None,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        """One transformer forward over a batch of rows of ``spec``'s geometry: row ``i`` at
        timestep ``t[i]`` (or ``t`` for all) under the text ``embeds[i]``, whose positions
        ``text_mask[i]`` keeps if the texts were padded, and with the image ``condition[i]``
        where the family takes one (``condition_shape``)."""

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance, in the family pipeline's exact operation order."""

    def step_cache_config(self, cache: StepCache, steps: int) -> Any:
        """The diffusers hook configuration that runs ``cache`` on this transformer, for a
        trajectory of ``steps``."""


class Decoder(Protocol):
    """Latents to uint8 frames (F, H, W, 3), chunk by chunk where the family is a video."""

    fingerprint: Fingerprint

    def frames(self, latents: torch.Tensor, spec: GenerationSpec) -> Iterator[np.ndarray]: ...


class Reference(Protocol):
    def __call__(self, spec: GenerationSpec, image: Image.Image | None = None,
                 mask: Image.Image | None = None) -> np.ndarray:
        """The pipeline's uint8 frames for ``spec``; ``image`` is the input image its hash
        names, ``mask`` its inpainting mask (as kept: 8-bit grey)."""
        ...


@dataclass(frozen=True, slots=True)
class Trainable:
    """What training a model of a family needs beyond its loaders (``training/``)."""

    # A pipeline of a preset's sizes with random weights drawn from the seed, not saved.
    untrained: Callable[[str, int], Any]
    # VAE latents (B, C, H, W) to the DiT's tokens, as the family's pipeline packs its noise.
    pack_latents: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its name, the diffusers pipeline class its folders name in
    ``model_index.json``, how to build a tiny one, and a loader per stage."""

    name: str
    pipeline_class: str
    limits: FamilyLimits
    presets: Sequence[str]
    build: Callable[[Path, str, int], None]
    # A family whose encoder reads each text with the request's image gives an ImageTextModel.
    text_encoder: Callable[[Path, Placement], TextEncoder | ImageTextModel]
    trajectory: Callable[[Path, Placement], Trajectory]
    denoiser: Callable[[Path, Placement], Denoiser]
    decoder: Callable[[Path, Placement], Decoder]
    # The family's monolithic diffusers pipeline, placed as the workers place the stages and
    # run on a request's first prompt segment: what the stages' output must equal bit for bit
    # (tests and benchmarks).
    reference: Callable[[Path, Placement], Reference]
    # Read from the folder's configs without loading a weight: what the API's cost estimate
    # and size rule need, published with the served model.
    geometry: Callable[[Path], ModelGeometry]
    # The VAE encode of input images, for a family that takes them (``limits`` says which
    # workflow: image-to-image or image-to-video); None for one that takes text only.
    image_encoder: Callable[[Path, Placement], ImageModel] | None = None
    # How to train one of its models from scratch; None for a family nothing here trains.
    trainable: Trainable | None = None


def component_config(directory: Path, component: str) -> dict[str, Any]:
    """A component's ``config.json``, as ``save_pretrained`` wrote it."""
    config: dict[str, Any] = json.loads((directory / component / "config.json").read_text())
    return config


def tokenizer_json(directory: Path) -> str:
    """The text encoder's tokenizer as ``tokenizers`` serializes it, published with the served
    model so that admission counts tokens as this folder does: its ``tokenizer.json`` where
    it has one, else the fast tokenizer transformers builds from the folder's files."""
    path = directory / "tokenizer" / "tokenizer.json"
    if path.exists():
        return path.read_text()
    from transformers import AutoTokenizer

    serialized: str = AutoTokenizer.from_pretrained(directory / "tokenizer").backend_tokenizer \
        .to_str()
    return serialized


MANIFEST = "diffcache-fingerprints.json"


def component_fingerprint(directory: Path, role: str, dtype: torch.dtype,
                          device: torch.device, split: str = "") -> Fingerprint:
    """The fingerprint of one component folder: its config, the digests of its weights, the
    dtype and the device class. Weight digests are computed once per folder and kept in a
    manifest beside the model, so a worker's start does not hash gigabytes of weights; an
    entry whose file changed size or time is computed again. ``split``: how the component's
    forwards are split over ranks, if they are (``Placement.dit_split``)."""
    component = directory / role
    config = json.loads((component / "config.json").read_text())
    config.pop("_diffusers_version", None)
    config.pop("transformers_version", None)
    manifest_path = directory / MANIFEST
    manifest: dict[str, dict[str, object]] = (
        json.loads(manifest_path.read_text()) if manifest_path.exists() else {})
    weights, changed = {}, False
    for path in sorted(component.glob("*.safetensors")):
        stat = path.stat()
        entry = manifest.get(f"{role}/{path.name}", {})
        if entry.get("size") != stat.st_size or entry.get("mtime_ns") != stat.st_mtime_ns:
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                     "digest": file_digest(path)}
            manifest[f"{role}/{path.name}"] = entry
            changed = True
        weights[path.name] = str(entry["digest"])
    if changed:
        partial = manifest_path.with_name(f".{MANIFEST}.{os.getpid()}.partial")
        partial.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        partial.replace(manifest_path)  # concurrent writers write the same digests
    # A split forward is its own device class: an exact hit never crosses splits whose bits
    # may differ. One rank's keys stay what they were.
    device_class = f"{device.type}/{split}" if split else device.type
    return model_fingerprint(role, config, weights, str(dtype), device_class)


def vae_encode_fingerprint(directory: Path, placement: Placement, pixels: torch.dtype,
                           produces: str) -> Fingerprint:
    """The VAE as it encodes an input image: its weights, dtype and device, the precision
    its pipeline casts the pixels to first, and what it makes of them (``produces``: two
    workflows' encodings of one image by one VAE are different tensors)."""
    vae = component_fingerprint(directory, "vae", placement.vae_dtype, placement.device)
    return Fingerprint("vae-encode", digest("vae-encode", {
        "vae": vae.hex, "pixels": str(pixels), "produces": produces}))


def check_condition(spec: GenerationSpec, condition: torch.Tensor | None,
                    takes: bool) -> None:
    """``Denoiser.predict``'s rows carry an image condition exactly where the model
    ``takes`` one."""
    if (condition is not None) != takes:
        raise ValueError(f"request {spec.request_id}: this model's forwards take "
                         f"{'an' if takes else 'no'} image condition")


def placed_pipeline(pipeline_class: Any, directory: Path, placement: Placement,
                    **components: Any) -> Any:
    """A monolithic pipeline with each component where the workers put it: the DiT and the
    text encoder in their dtype, the VAE in its own, all on the device. The VAE is loaded in
    its dtype, as the workers load it: loaded with the rest and cast after, its weights would
    have been rounded through the DiT's (bfloat16 on a GPU). ``components``: those given,
    not loaded (a processor transformers cannot load here)."""
    import diffusers

    _, vae_class = json.loads((directory / "model_index.json").read_text())["vae"]
    vae = getattr(diffusers, vae_class).from_pretrained(directory / "vae",
                                                        dtype=placement.vae_dtype)
    pipe = pipeline_class.from_pretrained(directory, vae=vae, dtype=placement.dit_dtype,
                                          **components)
    # The device alone: ``from_pretrained`` gave each its dtype, keeping in float32 the
    # modules the model keeps so (Wan's ``_keep_in_fp32_modules``), as the workers' loads do;
    # a cast here would round them to bfloat16 on a GPU.
    pipe.text_encoder.to(placement.device)
    pipe.transformer.to(placement.device)
    pipe.vae.to(placement.device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sibling_pipeline(pipeline_class: Any, pipe: Any) -> Any:
    """Another monolithic pipeline over ``pipe``'s components (img2img, inpainting), so a
    reference loads its weights once."""
    sibling = pipeline_class(**pipe.components)
    sibling.set_progress_bar_config(disable=True)
    return sibling


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] to uint8, as ``diffusers`` does for PIL output."""
    return (frames * 255).round().astype(np.uint8)
