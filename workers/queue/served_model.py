"""Which model a deployment serves, with its request defaults and its family's request
limits, as plain data.

Workers publish the family they loaded, with its limits, the request defaults of its model
folder and its tokenizer, to Redis when they start; admission reads them from there (it never
imports model code) to fill and check requests and to name the model in records, ``/metrics``
and the dashboard.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import xxhash
from pydantic import TypeAdapter
from redis.client import Pipeline

from cachesvc.redis_client import RedisClient
from cachesvc.wire import UNVERSIONED, Wire, WireError
from config.settings import ModelSettings
from keys import GenerationSpec, StepCachePolicy
from keys.names import lora_targets, served_model, served_tokenizer

log = logging.getLogger(__name__)

def size_at_area(width: int, height: int, area: int, multiple: int) -> tuple[int, int]:
    """An image of ``width`` x ``height`` in its aspect at about ``area`` pixels, each side
    rounded to a multiple of ``multiple``: how an editing family sizes its condition image
    (``FamilyLimits.condition_area`` and ``condition_multiple`` say by what)."""
    ratio = width / height
    side = math.sqrt(area * ratio)
    return round(side / multiple) * multiple, round(side / ratio / multiple) * multiple


class Workflow(StrEnum):
    """What a family's requests may make of their inputs, as the family declares them."""

    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_VIDEO = "text-to-video"
    IMAGE_TO_IMAGE = "image-to-image"  # starts from an input image, noised by ``strength``
    INPAINTING = "inpainting"  # image-to-image under a mask
    INSTRUCTION_EDIT = "instruction-edit"  # every step takes the image; one picture out
    IMAGE_TO_VIDEO = "image-to-video"  # every step takes the image; a video out


@dataclass(frozen=True, slots=True)
class FamilyLimits:
    """What a request to this family may ask for, beyond the deployment's own limits; each
    family module states its own, and workers publish them with the served model."""

    video: bool  # False: one frame only, and no MP4
    frame_multiple: int  # num_frames must be frame_multiple * k + 1 (video families)
    spatial_multiple: int  # width and height: VAE factor times DiT patch size
    max_prompt_tokens: int  # what the text encoder keeps of a prompt, less what it adds
    # What its requests may do with an input image: admission reads every rule of inputs
    # (needed, refused, noised by strength, masked) from these.
    workflows: frozenset[Workflow]
    # An editing family's: the pixels its pipeline brings the condition image to (and so its
    # output's default size); a model card's ``condition_area`` lowers it for tiny models.
    condition_area: int | None = None
    # An editing family's: what its pipeline rounds each side of the condition image to.
    condition_multiple: int = 32
    # What no prompt may hold: the markers of the template the family puts prompts in (an
    # editing model's image tokens), which would give the image's place twice.
    reserved_texts: tuple[str, ...] = ()
    # The step-cache policies the family's denoiser drives on any model (MagCache also runs
    # where the model's card ships calibrated ratios: ``ServedModel.step_caches``).
    step_caches: frozenset[StepCachePolicy] = frozenset(
        {StepCachePolicy.FIRST_BLOCK, StepCachePolicy.TAYLORSEER})

    def __post_init__(self) -> None:
        makes = ({Workflow.TEXT_TO_VIDEO, Workflow.IMAGE_TO_VIDEO} if self.video else
                 {Workflow.TEXT_TO_IMAGE, Workflow.IMAGE_TO_IMAGE, Workflow.INPAINTING,
                  Workflow.INSTRUCTION_EDIT})
        if not self.workflows or not self.workflows <= makes:
            raise ValueError(f"a {'video' if self.video else 'image'} family's workflows are "
                             f"some of {sorted(makes)}, not {sorted(self.workflows)}")
        if self.inpainting and not self.image_to_image:
            raise ValueError("inpainting is a kind of image-to-image: declare both")

    @property
    def image_to_image(self) -> bool:
        """Whether a request may start from an input image."""
        return Workflow.IMAGE_TO_IMAGE in self.workflows

    @property
    def inpainting(self) -> bool:
        """Whether an image-to-image request may give a mask."""
        return Workflow.INPAINTING in self.workflows

    @property
    def image_edit(self) -> bool:
        """Whether a request must give an image, which every step takes, for one picture."""
        return Workflow.INSTRUCTION_EDIT in self.workflows

    @property
    def image_to_video(self) -> bool:
        """Whether a request must give an image, which every step takes, for a video."""
        return Workflow.IMAGE_TO_VIDEO in self.workflows

    @property
    def image_conditions(self) -> bool:
        """Whether a request must give an image, which every step takes (no strength)."""
        return self.image_to_video or self.image_edit


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What a request's compute depends on in the served model's own folder, read from its
    configs by the family: the cost estimate, the size rule and the model info use it."""

    spatial_factor: int  # pixels per DiT token side: the VAE's factor times the patch size
    frame_factor: int  # pixel frames per latent frame (1 for an image family)
    layers: int  # transformer blocks of the DiT
    width: int  # the DiT's hidden size

    def cost(self, spec: GenerationSpec) -> int:
        """A request's estimated compute in token-forwards: the DiT's tokens (latent frames
        times patches) times the forwards it runs (a step with CFG runs two; image-to-image
        runs only the steps from ``first_step``)."""
        forwards = sum(2 if spec.segment_uses_cfg(spec.schedule[seg]) else 1
                       for seg in spec.step_segments()[spec.first_step:])
        return self.tokens(spec.width, spec.height, spec.num_frames) * forwards

    def tokens(self, width: int, height: int, frames: int) -> int:
        """The DiT's image tokens in a row of that size: latent frames times patches."""
        latent_frames = (frames - 1) // self.frame_factor + 1
        return latent_frames * (height // self.spatial_factor) * (width // self.spatial_factor)


# A model folder may carry this card; its "request_defaults" are what a request to that model
# gets for the fields it leaves out (the trained shapes model is only good at 32x32).
MODEL_CARD = "diffcache.json"


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """Sized, for a model without a card, so that one request takes seconds on 2 CPU cores."""

    width: int = 96
    height: int = 96
    num_frames: int = 9  # an image family makes one frame whatever this says
    num_inference_steps: int = 20
    guidance_scale: float = 5.0

    def frames(self, video: bool) -> int:
        """The frames of a request that names none: an image family makes one."""
        return self.num_frames if video else 1


class ModelCardError(ValueError):
    """A model folder's card that cannot be read."""


def request_defaults(model: ModelSettings, directory: Path) -> RequestDefaults:
    """The model card's defaults (the built-in ones without a card), under any the settings
    set explicitly."""
    defaults = RequestDefaults()
    card = directory / MODEL_CARD
    if card.exists():
        try:
            given = json.loads(card.read_text()).get("request_defaults", {})
            defaults = replace(defaults, **given)
        except (ValueError, TypeError, AttributeError) as error:
            raise ModelCardError(f"{card}: unreadable request_defaults ({error})") from error
    chosen = {f.name: getattr(model, f.name) for f in fields(RequestDefaults)
              if getattr(model, f.name) is not None}
    return replace(defaults, **chosen)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a model folder's card says of the model beyond its request defaults: the size it
    was trained at, the largest it serves, and the prompts it knows."""

    native_width: int | None = None
    native_height: int | None = None
    max_width: int | None = None
    max_height: int | None = None
    prompts: str = ""  # the kinds of prompt it was trained on, in a sentence
    vocabulary: tuple[str, ...] = ()  # every word its training captions hold; () for any
    # MagCache's calibrated ratios for the card's step count (``training.magcache``); none:
    # the model cannot run MagCache.
    magcache_ratios: tuple[float, ...] = ()
    # Approximate reuse: (least similarity, fraction of the steps reused) rows, measured
    # with the quality yardstick (``bench.reuse_calibrate``); none: the model reuses nothing.
    reuse_table: tuple[tuple[float, float], ...] = ()
    # The vector the table's similarities are measured in (``workers/stages/prompt_view.py``):
    # the text encoder's mean, or the denoiser's first prediction (or the prompt's effect on
    # it).
    reuse_vector: str = "text-mean"
    # The least agreement, on the source's own latents at the step reused, between what the
    # two prompts do to the prediction (``PromptEffect.agreement``): below it that step is
    # too late to switch prompts; None, no such check (``bench.reuse_calibrate``).
    reuse_agreement: float | None = None
    # Instruction editing: the pixels the condition image is brought to; None, the pipeline's
    # megapixel (only tiny test models take less, their reference patched to match).
    condition_area: int | None = None

    def warnings(self, spec: GenerationSpec) -> list[str]:
        """What a request asks for outside what the model was trained on: it runs, and
        the answer says so."""
        out = []
        native = (self.native_width, self.native_height)
        if self.native_width and (spec.width, spec.height) != native:
            out.append(f"the model was trained at {native[0]}x{native[1]}; "
                       f"{spec.width}x{spec.height} is outside what it learnt")
        if self.vocabulary:
            known = set(self.vocabulary)
            unknown = sorted({w for seg in spec.schedule for w in _words(seg.prompt)
                              if w not in known})
            if unknown:
                out.append(f"the model was trained on {self.prompts or 'other prompts'}; "
                           f"it never saw: {', '.join(unknown)}")
        return out


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def model_card(directory: Path) -> ModelCard:
    """The card's model facts; an empty ModelCard for a folder without a card."""
    card = directory / MODEL_CARD
    if not card.exists():
        return ModelCard()
    try:
        facts = json.loads(card.read_text()).get("model", {})
        return ModelCard(**{**facts, "vocabulary": tuple(facts.get("vocabulary", ())),
                            "magcache_ratios": tuple(facts.get("magcache_ratios", ())),
                            "reuse_table": tuple((float(s), float(f)) for s, f in
                                                 facts.get("reuse_table", ()))})
    except (ValueError, TypeError, AttributeError) as error:
        raise ModelCardError(f"{card}: unreadable model facts ({error})") from error


@dataclass(frozen=True, slots=True)
class ServedModel:
    family: str
    name: str  # what clients call it (``workers.main.model_name``)
    limits: FamilyLimits
    defaults: RequestDefaults = RequestDefaults()
    # Read by the workers from the folder itself; None where it is not known, when the
    # family's limits stand in for the size rule and the cost.
    geometry: ModelGeometry | None = None
    card: ModelCard = ModelCard()
    tokenizer: str = ""  # the content hash its tokenizer is published under; set by publishing
    # Ranks each denoise worker's forwards split over (``workers.denoise_parallel``): a
    # split forward runs no step cache and no adapter yet.
    denoise_ranks: int = 1
    # Equal parts a row's image tokens must split into there (1: any number of tokens).
    token_parts: int = 1

    @property
    def step_caches(self) -> frozenset[StepCachePolicy]:
        """The step-cache policies this model runs: its family's, and MagCache where its card
        ships calibrated ratios. None where the denoise workers split their forwards
        (``split_refusal``)."""
        if self.denoise_ranks > 1:
            return frozenset()
        if self.card.magcache_ratios:
            return self.limits.step_caches | {StepCachePolicy.MAGCACHE}
        return self.limits.step_caches

    @property
    def split_refusal(self) -> str | None:
        """Why a request may not ask for what a split forward cannot run yet (step caches,
        adapters); None where the denoise workers do not split their forwards."""
        if self.denoise_ranks == 1:
            return None
        return (f"the served model's denoise workers split each forward over "
                f"{self.denoise_ranks} ranks (workers.denoise_parallel), where it does not "
                "run yet")

    @property
    def spatial_multiple(self) -> int:
        """What width and height must be multiples of."""
        return self.geometry.spatial_factor if self.geometry else self.limits.spatial_multiple

    def size_for_image(self, width: int, height: int) -> tuple[int, int] | None:
        """The output size an editing model gives a request that names none, for an input
        image of ``width`` x ``height``, as its pipeline defaults it: the image's condition
        size. None for any other family, whose requests take the model's default size."""
        if self.limits.condition_area is None:
            return None
        return size_at_area(width, height,
                            self.card.condition_area or self.limits.condition_area,
                            self.limits.condition_multiple)

    def cost(self, spec: GenerationSpec) -> int:
        geometry = self.geometry or ModelGeometry(self.limits.spatial_multiple,
                                                  self.limits.frame_multiple, 0, 0)
        return geometry.cost(spec)


def _with_workflows(value: Any) -> ServedModel:
    """A served model as a worker of a release before workflows published it (version 1, or
    bare before the envelope): its limits said with four booleans what a family's requests
    may do with an input image, which name the same workflows."""
    limits = dict(value["limits"])
    flags = {name: bool(limits.pop(name, False)) for name in
             ("image_to_image", "image_to_video", "inpainting", "image_edit")}
    if flags["image_to_video"]:
        flows = {Workflow.IMAGE_TO_VIDEO}
    elif flags["image_edit"]:
        flows = {Workflow.INSTRUCTION_EDIT}
    else:
        flows = {Workflow.TEXT_TO_VIDEO if limits["video"] else Workflow.TEXT_TO_IMAGE}
    flows |= {Workflow.IMAGE_TO_IMAGE} if flags["image_to_image"] else set()
    flows |= {Workflow.INPAINTING} if flags["inpainting"] else set()
    limits["workflows"] = sorted(flows)
    return _READ_SERVED({**value, "limits": limits})


_READ_SERVED = TypeAdapter(ServedModel).validate_python
# During a rolling upgrade a new API still admits against what an old worker published, in
# either older shape. (An old API reads this version as no model served: 503 until its own
# release arrives, never a model admitted under limits it misread.)
_SERVED: Wire[ServedModel] = Wire("served model", ServedModel, version=2, older={
    1: _with_workflows, UNVERSIONED: _with_workflows})


RETIRED_TOKENIZER_S = 3600  # how long the tokenizer of a model no longer served is kept


class NotPublishedError(RuntimeError):
    """No worker has published the served model (or its tokenizer) yet, so a request cannot
    be checked: retry once a worker has started."""


def publish_served(client: RedisClient, model: ServedModel, tokenizer_json: str) -> None:
    """Publish the model with its tokenizer (``tokenizer.json`` text): the tokenizer first,
    under its content hash, so whoever reads the model finds its tokenizer there too. Workers
    of one deployment publish the same tokenizer, which travels once. When the tokenizer
    changes, the old one is kept an hour for admissions that read the old model, then goes."""
    digest = xxhash.xxh3_128_hexdigest(tokenizer_json.encode())
    tokenizer = served_tokenizer(digest)
    entry = _SERVED.encode(replace(model, tokenizer=digest))

    # One transaction on the model key: workers of two models starting together (a model
    # change) must not retire the tokenizer of the model that ends up published.
    def swap(pipe: Pipeline) -> None:
        present = pipe.exists(tokenizer)
        raw = pipe.get(served_model())
        previous = _tokenizer_of(raw) if raw is not None else None
        pipe.multi()
        if not present:
            pipe.set(tokenizer, tokenizer_json)
        pipe.persist(tokenizer)  # it may have been retired by an earlier model change
        pipe.set(served_model(), entry)
        if previous and previous != digest:
            pipe.expire(served_tokenizer(previous), RETIRED_TOKENIZER_S)

    client.transaction(swap, served_model())


def _tokenizer_of(raw: bytes | str) -> str | None:
    """The tokenizer digest of a served-model entry; None for one this release cannot read."""
    try:
        return _SERVED.decode(raw).tokenizer
    except WireError:
        return None


def read_served(client: RedisClient) -> ServedModel | None:
    """What the workers last said they serve; None before any worker started."""
    raw = client.get(served_model())
    if raw is None:
        return None
    try:
        found = _SERVED.decode(raw)
    except WireError as exc:
        log.warning("ignoring an unreadable served-model entry (%s)", exc)
        return None
    return found


def served(client: RedisClient) -> ServedModel:
    """What the workers serve, with a tokenizer published; NotPublishedError before then."""
    found = read_served(client)
    if found is None or not found.tokenizer:
        raise NotPublishedError("no worker has said which model it serves yet; retry once a "
                                "worker has started")
    return found


def read_tokenizer(client: RedisClient, digest: str) -> str:
    """The tokenizer published under ``digest``, as ``tokenizer.json`` text."""
    raw = client.get(served_tokenizer(digest))
    if raw is None:
        raise NotPublishedError(f"the served model's tokenizer {digest} is not in Redis; "
                                "retry once a worker has started (it publishes it again)")
    return bytes(raw).decode()  # type: ignore[arg-type]


_TARGET: Wire[tuple[int, int]] = Wire("lora target", tuple[int, int])  # (out, in)


def publish_lora_targets(client: RedisClient, linears: Mapping[str, tuple[int, int]]) -> None:
    """The served denoiser's linear layers (name -> (out, in)), which adapters must fit."""
    pipe = client.pipeline(transaction=True)  # MULTI on a cluster too: readers never see it empty
    pipe.delete(lora_targets())
    if linears:
        pipe.hset(lora_targets(), mapping={k: _TARGET.encode(shape)
                                           for k, shape in linears.items()})
    pipe.execute()


def read_lora_targets(client: RedisClient) -> dict[str, tuple[int, int]]:
    """What denoise workers last published; empty before one started."""
    raw: dict[bytes, bytes] = client.hgetall(lora_targets())  # type: ignore[assignment]
    out: dict[str, tuple[int, int]] = {}
    for name, value in raw.items():
        try:
            out[name.decode()] = _TARGET.decode(value)
        except WireError as exc:  # an older worker's; the next to start publishes again
            log.warning("ignoring an unreadable LoRA target %r (%s)", name, exc)
    return out
