"""Request and response bodies, validated once at the edge.

Limits come from the settings object, so the schema is built per app by ``request_model``;
every error names the field and the limit it broke.
"""

from __future__ import annotations

from typing import Annotated, Literal

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
from workers.queue.admission import MAX_GUIDANCE, MAX_SEED
from workers.queue.schema import PreemptMode

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


class AdapterOut(BaseModel):
    """An uploaded LoRA adapter."""

    name: str
    hash: str = Field(description="xxh3-128 of the file: what requests and keys hold")
    size: int
    rank: int
    targets: int = Field(description="linear layers of the denoiser it adapts")


class ImageOut(BaseModel):
    """An uploaded input image, as the service keeps it."""

    hash: str = Field(description="xxh3-128 of its size and 8-bit RGB pixels, after EXIF "
                      "orientation: the same picture in any encoding has one hash")
    width: int
    height: int


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


class PreemptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: PreemptMode = Field(PreemptMode.REQUEUE, description="requeue: resume on the next "
                              "free worker; park: wait for POST /v1/resume")


def segment_texts(prefix: str, segments: list[Segment] | None
                  ) -> tuple[tuple[str, str | None], ...]:
    return tuple((f"{prefix}.{i}.{role}", text) for i, s in enumerate(segments or [])
                 for role, text in (("prompt", s.prompt), ("negative_prompt", s.negative_prompt)))


def body_texts(body: GenerateBody) -> tuple[tuple[str, str | None], ...]:
    """A generate body's texts, each with the field it came from."""
    return (("prompt", body.prompt), ("negative_prompt", body.negative_prompt),
            *segment_texts("schedule", body.schedule))


class Accepted(BaseModel):
    id: str
    status_url: str
    result_url: str
    warnings: list[str] = Field(default_factory=list, description="what the request asks "
                                "outside what the served model learnt (its native size, its "
                                "training prompts): it runs, and may come out wrong")


class StepCacheStatus(BaseModel):
    """A request's step cache and what it did: forwards run under it, and those it skipped
    part of (first_block: the blocks after the first; taylorseer: the attention)."""

    policy: StepCachePolicy
    params: dict[str, float | int]
    forwards: int
    skipped: int


class ReuseStatus(BaseModel):
    """What approximate reuse did to a request."""

    mode: ReuseMode
    approximate: bool = Field(description="rewritten to start from another request")
    source_request_id: str | None = Field(None, description="the request (of this tenant) "
                                          "whose first steps it reused")
    steps_reused: int = 0
    similarity: float | None = None
    effective_seed: int = Field(description="the seed of the noise it started from: the "
                                "source's when approximate")


class RequestStatus(BaseModel):
    id: str
    state: str
    step: int
    steps: int
    output_format: str
    priority: str
    stage_seconds: dict[str, float]
    cache_hits: dict[str, int]
    resumed_from: int = Field(description="the step this attempt started at: >0 when it "
                              "resumed from a checkpoint (preemption, crash, shared prefix), "
                              "or for image-to-image where its strength starts the trajectory")
    checkpoints: list[int] = Field(description="steps with a checkpoint to branch from")
    preemptions: int
    model: dict[str, str] | None = Field(description="the family and model folder that serve "
                                         "the request")
    recomputed: dict[str, int] = Field(description="kind -> times an entry of that kind was "
                                       "lost from the cache and made again")
    loras: list[dict[str, str | float]] = Field(default_factory=list, description="the "
                                                "adapters applied: hash and scale")
    warnings: list[str] = Field(default_factory=list, description="as in the 202 answer")
    step_cache: StepCacheStatus | None = Field(None, description="absent when off")
    reuse: ReuseStatus
    rescues: int = Field(0, description="times the watchdog re-queued the request because "
                         "no live worker owned it (each one is a bug report)")
    late: dict[str, int] = Field(default_factory=dict, description="counter -> what attempts "
                                 "refused after the request ended still spent; the counters "
                                 "above are final once the request has ended")
    error: str | None
    created_at: float
    updated_at: float


class ChildState(BaseModel):
    """One supervised process, as its supervisor last published it."""

    name: str
    role: str
    pid: int | None
    alive: bool
    restarts: int
    last_exit: str
    last_error: str
    crash_looping: bool


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool] = Field(description="redis, store (a real put and get), and a "
                                    "worker heartbeat per stage")
    not_ready: dict[str, str] = Field(default_factory=dict, description="check -> why it "
                                      "fails, for every failing check")
    children: list[ChildState] = Field(description="supervised processes; a crash-looping one "
                                       "makes the service not ready")


class ErrorBody(BaseModel):
    error: str
    field: str | None = None


# --- OpenAI- and SGLang-compatible bodies ------------------------------------------------------


class _ImageCall(BaseModel):
    """What OpenAI's image routes share (the fields a diffusion server can honour)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=1, description="one image per call")
    size: Annotated[str, Field(
        pattern=r"^(\d{1,4}x\d{1,4}|auto)$",
        description="WxH; auto, or none, for the model's default (for an editing model, the "
                    "input image's aspect at the size its pipeline brings the image to)")
                    ] | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: str | None = None
    negative_prompt: str = ""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_inference_steps: Steps | None = None
    guidance_scale: float | None = Field(None, ge=0.0, le=MAX_GUIDANCE)
    keep: bool = Field(False, description="extension: keep the request running when the "
                       "call is abandoned (the client goes away, or the wait times out); by "
                       "default it is cancelled, and a retry of the call resumes it")


class ImagesBody(_ImageCall):
    """OpenAI ``POST /v1/images/generations``."""

    loras: list[LoraBody] = Field(default_factory=list, description="extension: LoRA "
                                  "adapters, as in POST /v1/generate")
    reuse: ReuseBody | None = Field(None, description="extension: approximate reuse, as in "
                                    "POST /v1/generate")


class EditsForm(_ImageCall):
    """OpenAI ``POST /v1/images/edits``, multipart as the official client sends it: the
    image (``image``, or ``image[]`` when the client sends a list) is served as image-to-image
    from it (inpainting, with a mask; an edit as the prompt says, on an editing model); its
    files are taken apart from these fields."""

    strength: float | None = Field(None, gt=0, le=1, description="extension: how far the "
                                   f"image is noised, as in POST /v1/generate (default "
                                   f"{DEFAULT_STRENGTH})")


class ModelFacts(BaseModel):
    """An extension of the OpenAI model object: what the served model knows."""

    family: str
    native_size: str | None = Field(description="the size it was trained at, WxH")
    max_size: str | None = Field(description="the largest it serves (api.enforce_model_max)")
    size_multiple: int = Field(description="width and height are multiples of this")
    prompts: str = Field(description="the kinds of prompt it was trained on")
    defaults: dict[str, int | float] = Field(description="what a request leaves out gets (but "
                                       "an editing model's size: its input image's)")


class ModelObject(BaseModel):
    """An OpenAI model object."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    diffcache: ModelFacts


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class VideosBody(BaseModel):
    """SGLang ``POST /v1/videos``."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    negative_prompt: str = ""
    size: Annotated[str, Field(pattern=r"^\d{1,4}x\d{1,4}$")] | None = None
    num_frames: Frames | None = None
    seconds: float | None = Field(None, gt=0, le=60)
    fps: int | None = Field(None, ge=1, le=60)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_inference_steps: Steps | None = None
    guidance_scale: float | None = Field(None, ge=0.0, le=MAX_GUIDANCE)
    loras: list[LoraBody] = Field(default_factory=list, description="extension: LoRA "
                                  "adapters, as in POST /v1/generate")
    reuse: ReuseBody | None = Field(None, description="extension: approximate reuse, as in "
                                    "POST /v1/generate")
    input_reference: str | None = Field(None, pattern=INPUT_IMAGE, description="the first "
                                        "frame an image-to-video model animates: an image's "
                                        "hash from POST /v1/images, or a data URL")


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    created_at: int
    error: str | None = None
    reuse: ReuseStatus | None = Field(None, description="extension: what approximate reuse "
                                      "did, as in the request's status")
