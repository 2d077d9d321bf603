"""One admission for every door: a request body, read against the model the workers publish
and the deployment's limits, becomes a ``GenerationSpec`` or a ``FieldError`` naming the field.

The native routes, the OpenAI and SGLang routes (which translate their shapes into a
``GenerateBody``) and ``diffcache submit`` all admit here; the queue's own door
(``workers.queue.admission``) then bounds what is queued.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from admission.body import GenerateBody, LoraBody, Overrides, body_texts
from admission.editing import (
    branched_spec,
    cfg_cache_from,
    reuse_from,
    segments_from,
    step_cache_from,
)
from config.settings import ApiSettings
from keys import (
    DEFAULT_STRENGTH,
    IMAGE_NOT_REUSED,
    MAGCACHE_PART_WAY,
    GenerationSpec,
    ImageInput,
    LoraUse,
    ReuseMode,
    StepCachePolicy,
    start_step,
)
from uploads.adapters import AdapterRegistry
from uploads.images import ImageStore, InputImage, normalise, normalise_mask
from workers.queue.admission import Admission, Asked, FieldError
from workers.queue.served_model import ServedModel
from workers.queue.submit import new_request_id

_Kept = TypeVar("_Kept", ImageStore, AdapterRegistry)


class NotFoundError(LookupError):
    """A request names an upload (an image, an adapter) its tenant does not have."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission, and the images that came with it, still to keep."""

    spec: GenerationSpec
    uploads: tuple[InputImage, ...]


@dataclass(frozen=True, slots=True)
class Named:
    """An input image a request names: its hash, its size where it was read, and itself
    where it came with the request, still to keep."""

    hash: str
    size: tuple[int, int] | None
    to_keep: tuple[InputImage, ...] = ()


@dataclass(frozen=True, slots=True)
class GivenImage:
    """What ``RequestAdmission.image_for`` makes of a request's input image: the image (None if it
    names none), its size where it was read, and the images still to keep."""

    input: ImageInput | None
    size: tuple[int, int] | None = None
    to_keep: tuple[InputImage, ...] = ()


def _strength(body: GenerateBody, served: ServedModel, steps: int) -> float | None:
    """How far an image-to-image request's image is noised; None for image-to-video and
    instruction editing, where the image conditions every step."""
    if served.limits.image_conditions:
        if body.strength is not None:
            raise FieldError("strength", f"applies to image-to-image only; the served "
                             f"{served.family} model {_takes(served)}, starting from pure "
                             "noise")
        return None
    strength = DEFAULT_STRENGTH if body.strength is None else body.strength
    if start_step(steps, strength) >= steps:
        raise FieldError("strength", f"{strength} leaves none of the {steps} steps to run")
    return strength


def _takes(served: ServedModel) -> str:
    """What a model whose every step takes the input image does with it."""
    return ("edits an input image as its prompt says" if served.limits.image_edit
            else "animates an input image")


def _wxh(size: tuple[int, int] | None) -> str:
    return "?" if size is None else f"{size[0]}x{size[1]}"


@dataclass(frozen=True, slots=True)
class RequestAdmission:
    """Reads request bodies for one deployment: the queue's checks of sizes, texts and cost
    under the limits and tenant defaults the API published (``queue``), the bounds on an
    image the API decodes (``api``), and the tenant's uploads a request may name (None at a
    door that takes none, ``diffcache submit``: a body naming one is refused there)."""

    api: ApiSettings
    queue: Admission
    images: ImageStore | None = None
    adapters: AdapterRegistry | None = None

    def admit(self, tenant: str, body: GenerateBody, served: ServedModel,
              uploads: Sequence[InputImage] = ()) -> Admitted:
        """The request ``body`` asks for, checked against every limit; ``uploads``: images
        its caller decoded, not yet kept, which ``body.image`` and ``body.mask`` may name."""
        if (body.prompt is None) == (body.schedule is None):
            raise FieldError("prompt", "give either prompt or schedule (exactly one)")
        steps = body.num_inference_steps
        if steps is None and body.schedule:
            steps = body.schedule[-1].until_step
        asked = Asked.of(served, body_texts(body), width=body.width, height=body.height,
                         frames=body.num_frames, steps=steps, output_format=body.output_format,
                         guidance_scale=body.guidance_scale, seed=body.seed)
        # An editing model's output left unsized takes its input image's size, so that image
        # is read first; any other request passes every cheap check before any store work.
        sized_by_image = (served.limits.image_edit and body.image is not None
                          and (body.width is None or body.height is None))
        if not sized_by_image:
            self.queue.check(asked, served)
        given = self.image_for(tenant, body, served, asked.steps, uploads, sized_by_image)
        if sized_by_image:
            assert given.size is not None  # read, as asked
            asked = self._admitted_at_image_size(asked, body, served, given.size)
        schedule = None
        if body.schedule is not None:
            schedule = segments_from(body.schedule, body.negative_prompt, "schedule", 0,
                                     asked.steps)
        image = given.input
        fixed = ("a request with a schedule cannot use it (give prompt instead)"
                 if body.schedule is not None else
                 IMAGE_NOT_REUSED if image else None)
        spec = GenerationSpec.create(
            request_id=new_request_id(), tenant=tenant, prompt=body.prompt or "",
            negative_prompt=body.negative_prompt, schedule=schedule, width=asked.width,
            height=asked.height, num_frames=asked.frames, num_inference_steps=asked.steps,
            guidance_scale=asked.guidance_scale,
            seed=secrets.randbelow(2**31) if body.seed is None else body.seed,
            output_format=asked.output_format, priority=body.priority,
            cfg_cache=cfg_cache_from(body.cfg_cache),
            loras=self.loras_for(tenant, body.loras, served),
            step_cache=step_cache_from(
                body.step_cache,
                self.queue.limits.step_cache_defaults.get(tenant, StepCachePolicy.OFF),
                served.step_caches, served.family, served.split_refusal,
                part_way=bool(image and image.strength is not None
                              and start_step(asked.steps, image.strength) > 0)),
            reuse=reuse_from(body.reuse, self.queue.limits.reuse_defaults.get(
                tenant, ReuseMode.EXACT), fixed), image=image)
        return Admitted(self.queue.within_cost(spec, served), given.to_keep)

    def _admitted_at_image_size(self, asked: Asked, body: GenerateBody, served: ServedModel,
                                image: tuple[int, int]) -> Asked:
        """``asked`` at the size an editing model's pipeline gives an output whose request
        names none (each side apart): the input image's aspect at the condition area;
        checked, a refusal of a side so made saying where it came from."""
        default = served.size_for_image(*image)
        assert default is not None  # an editing model's
        by_image = [name for name in ("width", "height") if getattr(body, name) is None]
        asked = replace(asked, width=body.width or default[0],
                        height=body.height or default[1])
        try:
            self.queue.check(asked, served)
        except FieldError as refused:
            if refused.field not in by_image:
                raise
            raise FieldError(refused.field, f"{refused.message}, the size the served model "
                             f"gives a {_wxh(image)} input image where the request names "
                             "none; give width and height (or raise api.max_width and "
                             "api.max_height)") from None
        return asked

    def image_for(self, tenant: str, body: GenerateBody, served: ServedModel, steps: int,
                  uploads: Sequence[InputImage], read_size: bool = False) -> GivenImage:
        """The input image a request starts from (image-to-image), animates
        (image-to-video) or edits, with its inpainting mask if it has one, each put back in
        the store if it was lost (another tenant's reads as unknown, 404); its size, if
        ``read_size`` (or it has a mask); and the images still to keep, those that came
        with the request (inline, or in ``uploads``)."""
        limits = served.limits
        if body.image is None:
            if limits.image_conditions:
                raise FieldError("image", f"the served {served.family} model "
                                 f"{_takes(served)}: give one")
            for field in ("strength", "mask"):
                if getattr(body, field) is not None:
                    raise FieldError(field, "applies to image-to-image only; give image too")
            return GivenImage(None)
        if not (limits.image_to_image or limits.image_conditions):
            raise FieldError("image", f"the served {served.family} model takes no input image")
        if body.mask is not None and not limits.inpainting:
            raise FieldError("mask", f"the served {served.family} model does no inpainting")
        strength = _strength(body, served, steps)
        if (body.step_cache is not None and body.step_cache.policy is StepCachePolicy.MAGCACHE
                and strength is not None and start_step(steps, strength) > 0):
            raise FieldError("step_cache.policy", MAGCACHE_PART_WAY)
        given = {upload.hash: upload for upload in uploads}
        image = self._input_image(tenant, body.image, given, "image",
                                  sized=body.mask is not None or read_size)
        if body.mask is None:
            return GivenImage(ImageInput(image.hash, strength), image.size, image.to_keep)
        mask = self._input_image(tenant, body.mask, given, "mask", sized=True)
        if mask.size != image.size:
            raise FieldError("mask", f"is {_wxh(mask.size)}, the image {_wxh(image.size)}: "
                             "a mask is its image's size")
        return GivenImage(ImageInput(image.hash, strength, mask.hash), image.size,
                          image.to_keep + mask.to_keep)

    def _input_image(self, tenant: str, given: str, uploads: dict[str, InputImage],
                     field: str, sized: bool) -> Named:
        """The image or mask ``given`` as a hash or a data URL (decoded, to keep), or one of
        ``uploads`` by its hash, else checked kept (and, if ``sized``, its size read)."""
        upload = (self.inline_image(given, field) if given.startswith("data:")
                  else uploads.get(given))
        if upload is not None:
            return Named(upload.hash, (upload.width, upload.height), (upload,))
        if sized:
            return Named(given, self._uploads(self.images, field).stored_size(tenant, given,
                                                                              field))
        self._uploads(self.images, field).ensure_stored(tenant, given, field)
        return Named(given, None)

    def inline_image(self, data_url: str, field: str = "image") -> InputImage:
        """An image (or, for ``field`` mask, a mask) given inline, decoded and checked as an
        upload is (kept once its request is admitted): requests name it by its hash after."""
        try:
            data = base64.b64decode(data_url.partition(",")[2], validate=True)
        except binascii.Error as exc:
            raise FieldError(field, f"is not valid base64 ({exc})") from None
        return self.decoded_image(data, field)

    def loras_for(self, tenant: str, loras: list[LoraBody],
                  served: ServedModel) -> tuple[LoraUse, ...]:
        """The tenant's adapters a request names; another tenant's read as unknown (404).
        Refused where the served model's forwards split over ranks (``split_refusal``)."""
        if loras and served.split_refusal:
            raise FieldError("loras", served.split_refusal)
        limit = self.queue.limits.max_loras
        if len(loras) > limit:
            raise FieldError("loras", f"{len(loras)} adapters; at most {limit} "
                             "(api.max_loras)")
        uses: dict[str, LoraUse] = {}
        for i, lora in enumerate(loras):
            if (lora.name is None) == (lora.hash is None):
                raise FieldError(f"loras[{i}]", "give either name or hash (exactly one)")
            adapters = self._uploads(self.adapters, "loras")
            found = adapters.find(tenant, name=lora.name, content_hash=lora.hash)
            if found is None:
                raise NotFoundError(f"loras[{i}]: no adapter {lora.name or lora.hash}; "
                                    "upload it with POST /v1/adapters")
            if found.hash in uses:
                raise FieldError(f"loras[{i}]", f"adapter {found.name} is named twice")
            adapters.ensure_stored(tenant, found.hash)
            uses[found.hash] = LoraUse(found.hash, lora.scale)
        return tuple(uses.values())

    @staticmethod
    def _uploads(kept: _Kept | None, field: str) -> _Kept:
        if kept is None:
            raise FieldError(field, "this door takes no uploads; give the request to the API")
        return kept

    def branch(self, spec: GenerationSpec, from_step: int, overrides: Overrides,
               served: ServedModel) -> GenerationSpec:
        """A new request from ``spec``'s checkpoint at ``from_step`` with ``overrides``
        (edit and resume), its texts checked as a new request's are."""
        return branched_spec(spec, new_request_id(), from_step, overrides,
                             self.queue.text_limits(served))

    def decoded_image(self, data: bytes, field: str = "image") -> InputImage:
        """An image file decoded and normalised, within the API's limits (a ``field`` mask
        as a mask: ``normalise_mask``); not kept yet."""
        api = self.api
        read = normalise_mask if field == "mask" else normalise
        return read(data, api.max_image_bytes, api.max_image_pixels, field)
