"""Request and response bodies, validated once at the edge.

Limits come from the settings object, so the schema is built per app by ``request_model``;
every error names the field and the limit it broke.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from cachesvc.settings import ApiSettings
from keys import OutputFormat, Priority

# How the built-in word-level tokenizer splits text (tokenizers' Whitespace pre-tokenizer).
_PRETOKEN = re.compile(r"\w+|[^\w\s]+")

MAX_SEED = 2**63 - 1


def token_count(text: str) -> int:
    return len(_PRETOKEN.findall(text))


# Static bounds, published in the OpenAPI schema. A deployment's ApiSettings may only tighten
# them, which ``check_limits`` does.
Spatial = Annotated[int, Field(ge=16, le=4096, multiple_of=16)]
Frames = Annotated[int, Field(ge=1, le=1025, description="4k+1")]
Steps = Annotated[int, Field(ge=1, le=1000)]


class GenerateBody(BaseModel):
    """``POST /v1/generate``. Deployment limits are applied by ``check_limits``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=20000)
    negative_prompt: str = Field("", max_length=20000)
    width: Spatial | None = Field(None, description="default: the model's width")
    height: Spatial | None = Field(None, description="default: the model's height")
    num_frames: Frames | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="default: random")
    output_format: OutputFormat = OutputFormat.MP4
    priority: Priority = Priority.INTERACTIVE


class FieldError(ValueError):
    """A request field outside its limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_limits(body: GenerateBody, width: int, height: int, frames: int, steps: int,
                 limits: ApiSettings) -> None:
    """Raise FieldError for the first field outside the limits of this deployment."""
    for name, text in (("prompt", body.prompt), ("negative_prompt", body.negative_prompt)):
        if len(text) > limits.max_prompt_chars:
            raise FieldError(name, f"must be at most {limits.max_prompt_chars} characters")
        if token_count(text) > limits.max_prompt_tokens:
            raise FieldError(name, f"must be at most {limits.max_prompt_tokens} tokens")
    m = limits.spatial_multiple
    for name, value, top in (("width", width, limits.max_width),
                             ("height", height, limits.max_height)):
        if not m <= value <= top or value % m:
            raise FieldError(name, f"must be a multiple of {m} from {m} to {top}, got {value}")
    if not 1 <= frames <= limits.max_frames or (frames - 1) % 4:
        raise FieldError("num_frames", f"must be 4k+1 from 1 to {limits.max_frames}, got {frames}")
    if not 1 <= steps <= limits.max_steps:
        raise FieldError("num_inference_steps", f"must be from 1 to {limits.max_steps}, "
                         f"got {steps}")
    if body.output_format is OutputFormat.PNG and frames != 1:
        raise FieldError("output_format", f"png holds one frame; set num_frames=1 (got {frames})")


class Accepted(BaseModel):
    id: str
    status_url: str
    result_url: str


class RequestStatus(BaseModel):
    id: str
    state: str
    step: int
    steps: int
    output_format: str
    stage_seconds: dict[str, float]
    cache_hits: dict[str, int]
    error: str | None
    created_at: float
    updated_at: float


class ErrorBody(BaseModel):
    error: str
    field: str | None = None


# --- OpenAI- and SGLang-compatible bodies ------------------------------------------------------


class ImagesBody(BaseModel):
    """OpenAI ``POST /v1/images/generations`` (the fields a diffusion server can honour)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    n: Literal[1] = 1
    size: Annotated[str, Field(pattern=r"^\d{1,4}x\d{1,4}$")] | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: str | None = None
    negative_prompt: str = ""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_inference_steps: Steps | None = None
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)


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
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0)


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    created_at: int
    error: str | None = None
