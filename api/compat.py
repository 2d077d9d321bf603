"""OpenAI-compatible image generation and SGLang-compatible video jobs, mapped onto the same
queue as ``/v1/generate``."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request, Response

from api.deps import Svc, Tenant
from api.schemas import GenerateBody, ImagesBody, VideoJob, VideosBody
from api.service import NotFoundError, NotReadyError, Service, WaitTimeoutError
from keys import OutputFormat
from workers.queue.schema import RequestRecord, State

_VIDEO_STATUS = {State.QUEUED: "queued", State.DONE: "completed", State.FAILED: "failed",
                 State.CANCELLED: "cancelled"}


def _size(size: str | None) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    width, height = size.split("x")
    return int(width), int(height)


def _frames(body: VideosBody) -> int | None:
    if body.num_frames is not None:
        return body.num_frames
    if body.seconds is None:
        return None
    frames = round(body.seconds * (body.fps or 16))
    return frames - (frames - 1) % 4  # the nearest 4k+1 at or below


def video_job(record: RequestRecord) -> VideoJob:
    steps = record.spec.num_inference_steps
    progress = 100 if record.state is State.DONE else int(100 * record.step / steps)
    return VideoJob(id=record.spec.request_id,
                    status=_VIDEO_STATUS.get(record.state, "in_progress"),
                    progress=progress, created_at=int(record.created_at),
                    error=record.error)


router = APIRouter()


@router.post("/v1/images/generations")
def images(body: ImagesBody, who: Tenant, svc: Svc, request: Request) -> dict[str, object]:
    """OpenAI-compatible and synchronous: answers when the image is ready. ``model``, when
    given, must name the served model (its folder, family, or ``family/folder``)."""
    served = svc.served()
    if body.model is not None and body.model not in (
            served.name, served.family, f"{served.family}/{served.name}"):
        raise NotFoundError(f"model {body.model!r} is not served here; this deployment "
                            f"serves {served.family}/{served.name}")
    width, height = _size(body.size)
    request_id = svc.generate(who, GenerateBody(
        prompt=body.prompt, negative_prompt=body.negative_prompt, width=width,
        height=height, num_frames=1, num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale, seed=body.seed,
        output_format=OutputFormat.PNG, loras=body.loras))
    record = _wait(svc, who, request_id, svc.settings.api.sync_timeout_s)
    if body.response_format == "url":
        # OpenAI clients fetch the URL as given: it must be absolute.
        base = svc.settings.api.public_url or str(request.base_url)
        item = {"url": f"{base.rstrip('/')}/v1/requests/{request_id}/result"}
    else:
        _, data = svc.result(who, request_id)
        item = {"b64_json": base64.b64encode(data).decode()}
    return {"created": int(record.created_at), "data": [item]}

@router.post("/v1/videos", response_model=VideoJob)
def create_video(body: VideosBody, who: Tenant, svc: Svc) -> VideoJob:
    """SGLang-compatible: queue a video and answer with its job."""
    width, height = _size(body.size)
    request_id = svc.generate(who, GenerateBody(
        prompt=body.prompt, negative_prompt=body.negative_prompt, width=width,
        height=height, num_frames=_frames(body),
        num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
        seed=body.seed, output_format=OutputFormat.MP4, loras=body.loras))
    return video_job(svc.record(who, request_id))

@router.get("/v1/videos/{video_id}", response_model=VideoJob)
def get_video(video_id: str, who: Tenant, svc: Svc) -> VideoJob:
    return video_job(svc.record(who, video_id))

@router.get("/v1/videos/{video_id}/content")
def video_content(video_id: str, who: Tenant, svc: Svc) -> Response:
    _, data = svc.result(who, video_id)
    return Response(data, media_type="video/mp4")


def _wait(svc: Service, tenant: str, request_id: str, timeout_s: float) -> RequestRecord:
    """The request once it is done, woken by its record's notifications."""
    try:
        *_, record = svc.events.follow(tenant, request_id, timeout_s)
    except TimeoutError as exc:
        raise WaitTimeoutError(f"request {request_id} did not finish within {timeout_s:.0f} s; "
                               f"poll /v1/requests/{request_id}") from exc
    if record.state is not State.DONE:
        raise NotReadyError(record)
    return record
