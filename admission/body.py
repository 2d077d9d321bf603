"""What a request asks for, as any door receives it: the bodies of a generation and a
resume, free of HTTP. The API's routes, the OpenAI and SGLang routes and the command line all
build these; ``admission.request`` checks them against the served model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from keys import (
    DEFAULT_MAX_SKIP,
    DEFAULT_STRENGTH,
    CfgMode,
    OutputFormat,
    Priority,
    ReuseMode,
    StepCachePolicy,
)
from workers.queue.admission import MAX_GUIDANCE, MAX_SEED, FieldError

# Static bounds, published in the OpenAPI schema. A deployment's ApiSettings may only tighten
# them, which admission's ``check_limits`` does.
Spatial = Annotated[int, Field(ge=1, le=4096, description="a multiple of the served model's "
                                                  "size_multiple (GET /v1/models)")]
Frames = Annotated[int, Field(ge=1, le=1025, description="4k+1")]
Steps = Annotated[int, Field(ge=1, le=1000)]
Guidance = Annotated[float, Field(ge=0.0, le=MAX_GUIDANCE)]
Prompt = Annotated[str, Field(min_length=1, max_length=20000)]
Negative = Annotated[str, Field(max_length=20000)]
MAX_SEGMENTS = 32


class Segment(BaseModel):
    """One entry of a prompt schedule: this prompt holds for the steps before ``until_step``,
    like ``[from:to:when]`` prompt editing."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    negative_prompt: Negative | None = Field(None, description="default: the request's")
    until_step: Steps
    guidance_scale: Guidance | None = Field(None, description="default: the request's")


class CfgCacheBody(BaseModel):
    """How the unconditional (CFG) branch may be reused. ``exact`` never changes the output;
    ``interval`` computes it every ``interval`` steps and extrapolates between (approximate)."""

    model_config = ConfigDict(extra="forbid")

    mode: CfgMode = CfgMode.EXACT
    interval: int | None = Field(None, ge=2, le=100, description="interval mode only")


class StepCacheBody(BaseModel):
    """A step-cache policy from diffusers' cache hooks (approximate: the output changes, and
    so do its keys). A parameter left out takes the policy's default."""

    model_config = ConfigDict(extra="forbid")

    policy: StepCachePolicy = StepCachePolicy.OFF
    threshold: float | None = Field(None, gt=0, le=1, description="first_block: how far block "
                                    "0's residual may move before the rest runs again; "
                                    "magcache: the error it may accumulate")
    interval: int | None = Field(None, ge=1, le=100, description="taylorseer: a full compute "
                                 "every interval steps")
    warmup: int | None = Field(None, ge=0, le=1000, description="taylorseer: steps computed "
                               "in full before forecasting")
    max_order: int | None = Field(None, ge=1, le=4, description="taylorseer: Taylor order")
    max_skip: int | None = Field(None, ge=1, le=100, description="magcache: steps it may skip "
                                 "in a row")

    def params(self) -> dict[str, float | int | None]:
        return {"threshold": self.threshold, "interval": self.interval,
                "warmup": self.warmup, "max_order": self.max_order, "max_skip": self.max_skip}


class ReuseBody(BaseModel):
    """Whether the request may start from a similar earlier request's checkpoint. In
    ``approximate`` mode it may be rewritten into "that request's first steps (its prompt, its
    seed), then this prompt", and the answer says so; ``exact`` never takes such a result."""

    model_config = ConfigDict(extra="forbid")

    mode: ReuseMode = ReuseMode.EXACT
    min_similarity: float = Field(0.9, gt=0, le=1, description="least cosine similarity of "
                                  "the pooled prompt embeddings")
    max_skip: float = Field(DEFAULT_MAX_SKIP, ge=0, lt=1, description="largest fraction of "
                            "the steps taken from the other request (the model's table "
                            "decides within it)")


class LoraBody(BaseModel):
    """One LoRA adapter a request applies, by the name it was uploaded under or its hash."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=64)
    hash: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    scale: float = Field(1.0, gt=0, le=10)



# An uploaded image's hash, or an image inline as a base64 data URL.
INPUT_IMAGE = r"^([0-9a-f]{32}|data:image/[a-z0-9.+-]+;base64,[A-Za-z0-9+/=]+)$"


class GenerateBody(BaseModel):
    """``POST /v1/generate``. Deployment limits are applied by ``check_limits``."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt | None = Field(None, description="required unless schedule is given")
    negative_prompt: Negative = ""
    schedule: list[Segment] | None = Field(None, min_length=1, max_length=MAX_SEGMENTS,
                                           description="prompt per step range, instead of "
                                           "prompt; the last until_step is the step count")
    width: Spatial | None = Field(None, description="default: the model's width (an editing "
                                  "model's: the input image's, at its condition area)")
    height: Spatial | None = Field(None, description="default: the model's height (an "
                                   "editing model's: the input image's, at its condition "
                                   "area)")
    num_frames: Frames | None = None
    num_inference_steps: Steps | None = Field(None, description="default: the model's, or the "
                                              "schedule's last until_step")
    guidance_scale: Guidance | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="default: random")
    output_format: OutputFormat | None = Field(None, description="default: mp4 for a video "
                                               "model, png for an image model")
    priority: Priority = Priority.INTERACTIVE
    cfg_cache: CfgCacheBody = CfgCacheBody()
    step_cache: StepCacheBody | None = Field(None, description="default: the tenant's "
                                             "(api.step_cache_defaults), else off")
    loras: list[LoraBody] = Field(default_factory=list, description="LoRA adapters to apply "
                                  "(at most api.max_loras), uploaded with POST /v1/adapters")
    reuse: ReuseBody | None = Field(None, description="default: the tenant's mode "
                                    "(api.reuse_defaults), else exact")
    image: str | None = Field(None, pattern=INPUT_IMAGE, description="the image an "
                              "image-to-image model starts from, the first frame an "
                              "image-to-video model animates, or the picture an editing "
                              "model edits (both require it): the "
                              "hash of an image uploaded with POST /v1/images, or the image "
                              "itself inline as a data URL (data:image/png;base64,...; within "
                              "api.max_body_bytes), resized to width x height (an editing "
                              "model's to its condition area, in its own aspect)")
    strength: float | None = Field(None, gt=0, le=1, description="image-to-image only: how "
                                   "far the image is noised (1: from noise, as with no "
                                   f"image); default {DEFAULT_STRENGTH}")
    mask: str | None = Field(None, pattern=INPUT_IMAGE, description="image-to-image only, "
                             "for inpainting: a mask of the image's size, as image is given "
                             "(a hash or a data URL); the prompt repaints where it is white, "
                             "or where it is fully transparent if it has transparency (as "
                             "OpenAI reads a mask), and every step keeps the rest of the image")


class Overrides(BaseModel):
    """What an edit-and-resume may change for the steps after ``from_step``. The fields that
    shape the checkpointed prefix are listed so that setting one gets a clear refusal."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt | None = None
    negative_prompt: Negative | None = None
    guidance_scale: Guidance | None = None
    schedule: list[Segment] | None = Field(None, min_length=1, max_length=MAX_SEGMENTS,
                                           description="for the remaining steps")
    output_format: OutputFormat | None = None
    priority: Priority | None = None
    width: int | None = Field(None, description="refused: changes the prefix")
    height: int | None = Field(None, description="refused: changes the prefix")
    num_frames: int | None = Field(None, description="refused: changes the prefix")
    num_inference_steps: int | None = Field(None, description="refused: changes the prefix")
    seed: int | None = Field(None, description="refused: changes the prefix")
    model: str | None = Field(None, description="refused: changes the prefix")
    cfg_cache: CfgCacheBody | None = Field(None, description="refused: changes the prefix")
    step_cache: StepCacheBody | None = Field(None, description="refused: changes the prefix")


PREFIX_FIELDS = ("width", "height", "num_frames", "num_inference_steps", "seed", "model",
                 "cfg_cache", "step_cache")


class ResumeBody(BaseModel):
    """``POST /v1/resume``: continue a preempted, cancelled or failed request, or (with
    overrides) branch a new request from one of its checkpoints."""

    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[str, Field(min_length=1, max_length=64)]
    from_step: int | None = Field(None, ge=1, le=1000,
                                  description="with overrides; default: the latest checkpoint")
    overrides: Overrides | None = None


def segment_texts(prefix: str, segments: list[Segment] | None
                  ) -> tuple[tuple[str, str | None], ...]:
    return tuple((f"{prefix}.{i}.{role}", text) for i, s in enumerate(segments or [])
                 for role, text in (("prompt", s.prompt), ("negative_prompt", s.negative_prompt)))


def body_texts(body: GenerateBody) -> tuple[tuple[str, str | None], ...]:
    """A generate body's texts, each with the field it came from."""
    return (("prompt", body.prompt), ("negative_prompt", body.negative_prompt),
            *segment_texts("schedule", body.schedule))


def field_error(error: Mapping[str, Any]) -> FieldError:
    """One of pydantic's errors in a body as admission's ``FieldError``: the field by its
    dotted path (``body`` for the body as a whole, none at all), the message with the limit
    it broke, as every door says it."""
    location = error["loc"]
    field = ".".join(str(p) for p in location if p not in ("body", "query", "path", "header"))
    if not field and tuple(location[:1]) == ("body",):
        field = "body"
    limit = error.get("ctx")
    return FieldError(field, f"{error['msg']}" + (f" ({limit})" if limit else ""))
