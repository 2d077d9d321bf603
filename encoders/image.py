"""Image conditions: an uploaded input image encoded by the family's VAE at a request's size
(and frame count, for image-to-video), or an inpainting mask brought to the latents' size (its
own kind), looked up with single-flight and computed on a miss from the stored image. The key
names the image by the hash of its pixels, so every request that edits or animates it at that
geometry shares one encode, whatever its prompt or seed."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image

from cachesvc.ledger import Ledger
from cachesvc.tensor_cache import TensorCache
from keys import Fingerprint, GenerationSpec, StoreKey, image_key, image_latent_key, image_mask_key


class ImageModel(Protocol):
    """What a model family that takes input images provides."""

    fingerprint: Fingerprint
    # Whether ``encode`` depends on the output's geometry (image-to-image, image-to-video), or
    # on the image alone (an edit's condition, brought to a fixed area in its own aspect):
    # then the key names no size, and one image edited at several sizes is encoded once.
    sized_by_output: bool
    # How a mask becomes the latents' mask (``encode_mask``); None for a family that does
    # no inpainting.
    mask_fingerprint: Fingerprint | None

    def encode(self, image: Image.Image, width: int, height: int, frames: int) -> torch.Tensor:
        """``image`` resized to ``width`` x ``height`` as the family's pipeline resizes it,
        then encoded as that pipeline encodes it: for image-to-image, to the VAE's latent
        distribution (its parameters: the pipeline samples from it with the request's seed, so
        the sample is the denoiser's to draw); for image-to-video, to the condition of a video
        of ``frames`` whose first frame it is, which every step takes."""
        ...

    def encode_mask(self, mask: Image.Image, width: int, height: int) -> torch.Tensor:
        """An inpainting ``mask`` (8-bit grey) resized to ``width`` x ``height`` and
        binarised as the family's inpainting pipeline does, then brought to the latents'
        size: 1 where the prompt repaints, 0 where each step keeps the input image."""
        ...


class ImageLostError(LookupError):
    """An image a request names is not in the store. Images are uploaded, not computed: the
    API puts a lost one back from disk before it admits or resumes a request, so only a store
    lost since then (or a deleted upload) leads here; resuming the request, or uploading the
    image again, is the remedy."""


@dataclass(frozen=True, slots=True)
class EncodedImage:
    key: StoreKey
    tensor: torch.Tensor


def encode_image(cache: TensorCache, model: ImageModel, spec: GenerationSpec,
                 ledger: Ledger | None = None) -> EncodedImage:
    """The encoding of ``spec``'s input image at its geometry (or at the size the image alone
    sets, for a model not ``sized_by_output``), from the cache where possible; the lookup
    counted in the job's ``ledger``."""
    if spec.image is None:
        raise ValueError(f"request {spec.request_id} names no input image")
    size = (spec.width, spec.height, spec.num_frames) if model.sized_by_output else None
    key = image_latent_key(spec.tenant, model.fingerprint, spec.image.hash, size)
    compute = functools.partial(stored_image, cache, spec, spec.image.hash, "RGB",
                                lambda image: model.encode(image, spec.width, spec.height,
                                                           spec.num_frames))
    return EncodedImage(key, cache.get_or_compute(key, compute, ledger).tensor)


def encode_mask(cache: TensorCache, model: ImageModel, spec: GenerationSpec,
                ledger: Ledger | None = None) -> EncodedImage:
    """``spec``'s inpainting mask at its latents' size, from the cache where possible (one
    per mask and size, its own ``image_mask`` kind: no VAE runs); the lookup counted in
    ``ledger``."""
    if spec.image is None or spec.image.mask is None:
        raise ValueError(f"request {spec.request_id} names no inpainting mask")
    if model.mask_fingerprint is None:
        raise ValueError(f"request {spec.request_id} names an inpainting mask, but the served "
                         "family does no inpainting")
    key = image_mask_key(spec.tenant, model.mask_fingerprint, spec.image.mask, spec.width,
                         spec.height)
    compute = functools.partial(stored_image, cache, spec, spec.image.mask, "L",
                                lambda mask: model.encode_mask(mask, spec.width, spec.height))
    return EncodedImage(key, cache.get_or_compute(key, compute, ledger).tensor)


def stored_image(cache: TensorCache, spec: GenerationSpec, content_hash: str, mode: str,
                 encode: Callable[[Image.Image], torch.Tensor]) -> torch.Tensor:
    """``encode`` of the stored image ``content_hash``, read in ``mode``; ImageLostError if
    the store has it no more."""
    stored = cache.get(image_key(spec.tenant, content_hash), lookup=False)  # an input
    if stored is None:
        raise ImageLostError(f"request {spec.request_id}: input image {content_hash} of "
                             f"tenant {spec.tenant} is not in the store; upload it again")
    # The PNG the API wrote from pixels it had checked (size, mode), read back checksummed.
    with Image.open(io.BytesIO(stored.numpy().tobytes())) as opened:
        image = opened.convert(mode)
    return encode(image)
