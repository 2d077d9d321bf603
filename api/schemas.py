"""The API's own bodies: its answers, its uploads' descriptions and the OpenAI and SGLang
routes' requests (what a generation or a resume asks is ``admission.body``'s). Every error
names the field and the limit it broke.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from admission.body import INPUT_IMAGE, Frames, LoraBody, ReuseBody, Steps
from keys import (
    DEFAULT_STRENGTH,
    ReuseMode,
    StepCachePolicy,
)
from workers.queue.admission import MAX_GUIDANCE, MAX_SEED
from workers.queue.schema import PreemptMode


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


class PreemptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: PreemptMode = Field(PreemptMode.REQUEUE, description="requeue: resume on the next "
                              "free worker; park: wait for POST /v1/resume")


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
    model: dict[str, str] | None = Field(description="the family and model name that serve "
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
    workflows: list[str] = Field(description="what its requests may make of an input image: "
                                 "text-to-image, text-to-video, image-to-image, inpainting, "
                                 "instruction-edit, image-to-video")
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
