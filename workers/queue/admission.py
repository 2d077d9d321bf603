"""Admission: the one path by which a new request enters the queue, whoever submits it.

It reads the model the workers serve, checks a request against the deployment's limits and the
family's (sizes, frames, prompt tokens, the model it names), caps its cost and submits it
within the queue bounds. The API and ``diffcache submit`` both go through it, so they refuse
the same requests with the same error, naming the same field.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from cachesvc.redis_client import RedisClient
from cachesvc.wire import Wire, WireError
from config.settings import ApiSettings
from keys import GenerationSpec, OutputFormat, Priority, ReuseMode, StepCachePolicy
from keys.names import admission_limits
from workers.queue.record_write import RecordWrite
from workers.queue.schema import WARNINGS, Field
from workers.queue.served_model import ServedModel, served
from workers.queue.submit import AdmissionError, Bounds, readmit, submit
from workers.queue.token_count import TokenCounter, TokenCounters

log = logging.getLogger(__name__)


class FieldError(ValueError):
    """A request field outside its limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFullError(RuntimeError):
    """Admitting the request would exceed a bound; the client should retry later."""

    def __init__(self, exc: AdmissionError) -> None:
        setting = "api.max_jobs_per_tenant" if exc.bound == "tenant" else "api.max_queue_depth"
        whose = f" for tenant {exc.tenant}" if exc.bound == "tenant" else ""
        super().__init__(f"{exc.limit} or more jobs are queued or running{whose} "
                         f"({setting}={exc.limit})")
        self.setting = setting
        self.limit = exc.limit


class UnknownModelError(LookupError):
    """A request names a model this deployment does not serve."""


# Bounds no deployment setting moves (the API's schema states them too).
MAX_GUIDANCE = 30.0
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """The deployment's limits on a request (``api.*`` settings), which the API publishes so
    that every door admits under the same ones; the API's keys stay out of it."""

    max_prompt_chars: int
    max_prompt_tokens: int
    spatial_multiple: int
    max_width: int
    max_height: int
    enforce_model_max: bool
    max_frames: int
    max_steps: int
    max_cost: int
    interactive_max_cost: int
    max_queue_depth: int
    max_jobs_per_tenant: int
    # What a request that names none gets, per tenant, and how many adapters it may name:
    # published too, so that ``diffcache submit`` on another machine admits as the API does.
    # (Defaults: what a release before these fields published.)
    max_loras: int = 4
    step_cache_defaults: Mapping[str, StepCachePolicy] = dataclasses.field(default_factory=dict)
    reuse_defaults: Mapping[str, ReuseMode] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, api: ApiSettings) -> Limits:
        return cls(**{f.name: getattr(api, f.name) for f in dataclasses.fields(cls)})


_LIMITS: Wire[Limits] = Wire("admission limits", Limits)


def publish_limits(client: RedisClient, limits: Limits) -> None:
    client.set(admission_limits(), _LIMITS.encode(limits))


def published_limits(client: RedisClient) -> Limits | None:
    """The limits the API last published; None before one started (or unreadable)."""
    raw = client.get(admission_limits())
    if raw is None:
        return None
    try:
        return _LIMITS.decode(raw)
    except WireError as exc:
        log.warning("ignoring unreadable admission limits (%s)", exc)
        return None


@dataclass(frozen=True, slots=True)
class TextLimits:
    """How long a prompt may be: characters, and tokens as the served model counts them."""

    max_chars: int
    max_tokens: int
    count: TokenCounter
    reserved: tuple[str, ...] = ()  # markers of the family's template a text may not hold


def check_texts(texts: tuple[tuple[str, str | None], ...], limits: TextLimits) -> None:
    """Raise FieldError for the first (field, text) longer than this deployment allows."""
    for name, text in texts:
        if text is None:
            continue
        if text == "" and not name.endswith("negative_prompt"):
            raise FieldError(name, "must not be empty")
        if len(text) > limits.max_chars:
            raise FieldError(name, f"must be at most {limits.max_chars} characters")
        for marker in limits.reserved:
            if marker in text:
                raise FieldError(name, f"holds {marker}, which marks the input image's place "
                                 "in the served model's template; leave it out")
        if (tokens := limits.count(text)) > limits.max_tokens:
            raise FieldError(name, f"must be at most {limits.max_tokens} tokens of the served "
                             f"model's tokenizer, got {tokens}")


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request asks for, the served model's defaults filled in; each text with the
    field it came from, so a refusal names that field."""

    texts: tuple[tuple[str, str | None], ...]
    width: int
    height: int
    frames: int
    steps: int
    output_format: OutputFormat
    guidance_scale: float
    seed: int | None = None  # None: a random one

    @classmethod
    def of(cls, model: ServedModel, texts: tuple[tuple[str, str | None], ...], *,
           width: int | None, height: int | None, frames: int | None, steps: int | None,
           output_format: OutputFormat | None, guidance_scale: float | None = None,
           seed: int | None = None) -> Asked:
        """What is asked, each field left out (None) taken from the served model's defaults:
        one frame and PNG for an image family, MP4 for a video one."""
        m, video = model.defaults, model.limits.video

        def given(value: int | None, default: int) -> int:
            return default if value is None else value

        return cls(texts, given(width, m.width), given(height, m.height),
                   given(frames, m.frames(video)),
                   given(steps, m.num_inference_steps),
                   output_format or (OutputFormat.MP4 if video else OutputFormat.PNG),
                   m.guidance_scale if guidance_scale is None else guidance_scale, seed)


def check_limits(asked: Asked, limits: Limits, model: ServedModel, texts: TextLimits) -> None:
    """Raise FieldError for the first field outside the limits of this deployment and of the
    model family it serves."""
    check_texts(asked.texts, texts)
    m = math.lcm(limits.spatial_multiple, model.spatial_multiple)
    card = model.card
    for name, value, top, card_top in (
            ("width", asked.width, limits.max_width, card.max_width),
            ("height", asked.height, limits.max_height, card.max_height)):
        if not m <= value <= top or value % m:
            raise FieldError(name, f"must be a multiple of {m} from {m} to {top}, got {value}")
        if limits.enforce_model_max and card_top is not None and value > card_top:
            raise FieldError(name, f"must be at most {card_top} for {model.name}, which was "
                             f"trained at {card.native_width}x{card.native_height} (its model "
                             f"card; api.enforce_model_max), got {value}")
    frames, output_format = asked.frames, asked.output_format
    if not model.limits.video:
        if frames != 1:
            raise FieldError("num_frames", f"{model.family} makes images: num_frames must be "
                             f"1, got {frames}")
        if output_format is OutputFormat.MP4:
            raise FieldError("output_format", f"{model.family} makes images: use png or npy")
    k = model.limits.frame_multiple
    if not 1 <= frames <= limits.max_frames or (frames - 1) % k:
        raise FieldError("num_frames", f"must be {k}k+1 from 1 to {limits.max_frames}, "
                         f"got {frames}")
    if model.token_parts > 1 and model.geometry is not None and (
            tokens := model.geometry.tokens(asked.width, asked.height, frames)) % model.token_parts:
        raise FieldError("width", f"{asked.width}x{asked.height}x{frames} is {tokens} image "
                         f"tokens a row, which do not split into {model.token_parts} equal "
                         "parts as the served model's denoise workers split them "
                         "(workers.denoise_parallel); choose another width, height or "
                         "num_frames")
    if not 1 <= asked.steps <= limits.max_steps:
        raise FieldError("num_inference_steps", f"must be from 1 to {limits.max_steps}, "
                         f"got {asked.steps}")
    if output_format is OutputFormat.PNG and frames != 1:
        raise FieldError("output_format", f"png holds one frame; set num_frames=1 (got {frames})")
    _check_sampling(asked)


def _check_sampling(asked: Asked) -> None:
    if not 0 <= asked.guidance_scale <= MAX_GUIDANCE:
        raise FieldError("guidance_scale", f"must be from 0 to {MAX_GUIDANCE:g}, got "
                         f"{asked.guidance_scale}")
    if asked.seed is not None and not 0 <= asked.seed <= MAX_SEED:
        raise FieldError("seed", f"must be from 0 to {MAX_SEED}, got {asked.seed}")


def model_ids(model: ServedModel) -> tuple[str, ...]:
    """The names a client may give the served model: ``family/name`` first."""
    return (f"{model.family}/{model.name}", model.name, model.family)


def check_model(name: str | None, model: ServedModel) -> None:
    """UnknownModelError unless ``name`` (when given) names the served model."""
    if name is not None and name not in model_ids(model):
        raise UnknownModelError(f"model {name!r} is not served here; this deployment serves "
                                f"{model_ids(model)[0]}")


class Admission:
    """Checks and submits new requests against one deployment's limits and bounds."""

    def __init__(self, client: RedisClient, limits: Limits) -> None:
        self._client = client
        self._limits = limits
        self._bounds = Bounds(limits.max_queue_depth, limits.max_jobs_per_tenant)
        self._tokens = TokenCounters(client)

    @property
    def limits(self) -> Limits:
        return self._limits

    def served(self) -> ServedModel:
        """The model the workers serve; NotPublishedError before any has said."""
        return served(self._client)

    def text_limits(self, model: ServedModel) -> TextLimits:
        """Prompt limits: the deployment's, tightened to what the served model keeps, with
        tokens counted by its own tokenizer."""
        return TextLimits(self._limits.max_prompt_chars,
                          min(self._limits.max_prompt_tokens, model.limits.max_prompt_tokens),
                          self._tokens.counter(model), model.limits.reserved_texts)

    def check(self, asked: Asked, model: ServedModel) -> None:
        check_limits(asked, self._limits, model, self.text_limits(model))

    def within_cost(self, spec: GenerationSpec, model: ServedModel) -> GenerationSpec:
        """Refuse a request that would hold a worker too long; run a costly interactive one
        as batch work, so it cannot hold up the small ones behind it."""
        cost = model.cost(spec)
        if cost > self._limits.max_cost:
            raise FieldError("cost", f"estimated cost {cost:,} token-forwards (latent tokens x "
                             f"steps x CFG branches) is above api.max_cost="
                             f"{self._limits.max_cost:,}; ask for a smaller size, fewer frames "
                             "or fewer steps")
        if spec.priority is Priority.INTERACTIVE and cost > self._limits.interactive_max_cost:
            return dataclasses.replace(spec, priority=Priority.BATCH)
        return spec

    def submit(self, spec: GenerationSpec, model: ServedModel) -> str:
        """Admit and submit in one script, so concurrent submits cannot overshoot a bound;
        the record names the model that serves it and what the request asks outside what
        the model learnt."""
        try:
            return submit(self._client, spec, bounds=self._bounds, fields=RecordWrite({
                Field.MODEL: f"{model.family}/{model.name}",
                Field.WARNINGS: WARNINGS.encode_str(tuple(model.card.warnings(spec)))}))
        except AdmissionError as exc:
            raise QueueFullError(exc) from exc

    def readmit(self, spec: GenerationSpec, *, bounded: bool = True) -> None:
        """Count an existing request as queued or running again (a resume): see ``readmit``."""
        try:
            readmit(self._client, spec, self._bounds if bounded else Bounds())
        except AdmissionError as exc:
            raise QueueFullError(exc) from exc
