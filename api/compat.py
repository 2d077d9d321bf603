"""OpenAI-compatible image generation and editing (image-to-image), and SGLang-compatible
video jobs (from text, or animating an input image), mapped onto the same queue as
``/v1/generate``."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated

import anyio.from_thread
import xxhash
from fastapi import APIRouter, File, Form, Header, Request, Response, UploadFile

from admission.body import GenerateBody
from api.deps import Svc, Tenant
from api.schemas import (
    EditsForm,
    ImagesBody,
    ModelFacts,
    ModelList,
    ModelObject,
    VideoJob,
    VideosBody,
)
from api.service import (
    ClientGoneError,
    Service,
    WaitTimeoutError,
    reuse_headers,
    reuse_status,
)
from cachesvc.errors import UploadError
from keys import OutputFormat
from uploads.images import InputImage
from workers.queue.admission import FieldError, check_model, model_ids
from workers.queue.client import NotReadyError
from workers.queue.schema import RequestRecord, State
from workers.queue.served_model import ServedModel

_VIDEO_STATUS = {State.QUEUED: "queued", State.DONE: "completed", State.FAILED: "failed",
                 State.CANCELLED: "cancelled"}


def _size(size: str | None) -> tuple[int | None, int | None]:
    if size is None or size == "auto":
        return None, None
    width, height = size.split("x")
    return int(width), int(height)


def _frames(body: VideosBody, served: ServedModel, fps: int) -> int | None:
    """``num_frames``, or ``seconds`` at ``fps`` (the body's, else the rate the deployment's
    MP4s play at) as the nearest length at or below that the served family takes
    (``frame_multiple`` k + 1)."""
    if body.num_frames is not None:
        return body.num_frames
    if body.seconds is None:
        return None
    frames = max(1, round(body.seconds * (body.fps or fps)))
    return frames - (frames - 1) % served.limits.frame_multiple


def video_job(record: RequestRecord) -> VideoJob:
    steps = record.spec.num_inference_steps
    progress = 100 if record.state is State.DONE else int(100 * record.step / steps)
    return VideoJob(id=record.spec.request_id,
                    status=_VIDEO_STATUS.get(record.state, "in_progress"),
                    progress=progress, created_at=int(record.created_at),
                    error=record.error, reuse=reuse_status(record))


router = APIRouter()


@router.post("/v1/images/generations")
def images(body: ImagesBody, who: Tenant, svc: Svc, request: Request,
           idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
           x_stainless_retry_count: Annotated[int | None, Header(ge=0)] = None
           ) -> dict[str, object]:
    """OpenAI-compatible and synchronous: answers when the image is ready. ``model``, when
    given, must name the served model (its name, family, or ``family/name``).

    A call abandoned before its image is ready (the client went away, or the wait passed
    ``api.sync_timeout_s``) cancels its request unless ``keep`` is set. A retry of the call
    (the same ``Idempotency-Key``, or the official SDK's own retry of the same body, which it
    marks with ``X-Stainless-Retry-Count``) joins the request the first call made, resuming it
    from its checkpoint if the abandonment cancelled it, instead of queueing another."""
    served = svc.served()
    check_model(body.model, served)
    _makes_images(served, "model")
    width, height = _size(body.size)
    generate = GenerateBody(
        prompt=body.prompt, negative_prompt=body.negative_prompt, width=width,
        height=height, num_frames=1, num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale, seed=body.seed,
        output_format=OutputFormat.PNG, loras=body.loras, reuse=body.reuse)
    call = SyncCall(body, body.model_dump_json().encode(), idempotency_key,
                    x_stainless_retry_count)
    return _answered(svc, who, request, generate, call)


EDITS = "/v1/images/edits"


@router.post(EDITS)
def edits(form: Annotated[EditsForm, Form()], who: Tenant, svc: Svc, request: Request,
          image: Annotated[list[UploadFile] | None, File(description="the image to "
                                                         "edit")] = None,
          images: Annotated[list[UploadFile] | None, File(
              alias="image[]", description="as the client sends a list; one is served")] = None,
          mask: Annotated[UploadFile | None, File(description="inpainting: repaint where "
                                                  "it is fully transparent (or white, if it "
                                                  "has no transparency); the image's size")
                          ] = None,
          idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
          x_stainless_retry_count: Annotated[int | None, Header(ge=0)] = None
          ) -> dict[str, object]:
    """OpenAI-compatible and synchronous, as ``/v1/images/generations``: the uploaded image
    (and mask) is kept as ``POST /v1/images`` keeps it (once the request is admitted) and the
    prompt runs image-to-image from it, inpainting where a mask is given (or, on an editing
    model, edits it as it says)."""
    served = svc.served()
    check_model(form.model, served)
    _makes_images(served, "image")
    files = [*(image or ()), *(images or ())]
    field = "image[]" if images and not image else "image"
    if len(files) != 1:
        raise FieldError(field, f"give exactly one image (got {len(files)}): the served "
                         "model edits one image at a time")
    kept = [svc.admission.decoded_image(files[0].file.read(), field)]  # kept once admitted
    if mask is not None:
        kept.append(svc.admission.decoded_image(mask.file.read(), "mask"))
    width, height = _size(form.size)
    generate = GenerateBody(
        prompt=form.prompt, negative_prompt=form.negative_prompt, width=width,
        height=height, num_frames=1, num_inference_steps=form.num_inference_steps,
        guidance_scale=form.guidance_scale, seed=form.seed, output_format=OutputFormat.PNG,
        image=kept[0].hash, strength=form.strength,
        mask=kept[1].hash if mask is not None else None)
    # The same fields on the same pixels are the same call, however the files were encoded.
    call = SyncCall(form, form.model_dump_json().encode()
                    + b"".join(k.hash.encode() for k in kept),
                    idempotency_key, x_stainless_retry_count)
    return _answered(svc, who, request, generate, call, kept)


def _makes_images(served: ServedModel, field: str) -> None:
    """OpenAI's image routes answer with an image: an image-to-video model is refused there,
    naming ``field`` (what the route's caller gave that does not fit)."""
    if served.limits.image_to_video:
        raise FieldError(field, f"the served {served.family} model animates images: send "
                         "one to POST /v1/videos as input_reference")


@dataclass(frozen=True, slots=True)
class SyncCall:
    """One call of a synchronous OpenAI route: what it asked, and what names it for a retry
    (the ``Idempotency-Key``, else a digest of what it asked)."""

    asked: ImagesBody | EditsForm
    content: bytes
    idempotency_key: str | None
    retry_count: int | None

    @property
    def name(self) -> str:
        # The SDK sends no key: its retry is the same call, marked as a retry.
        return self.idempotency_key or f"openai-call:{xxhash.xxh3_128_hexdigest(self.content)}"


def _answered(svc: Service, who: str, request: Request, generate: GenerateBody,
              call: SyncCall, uploads: Sequence[InputImage] = ()) -> dict[str, object]:
    """Queue ``generate`` for ``call`` (or join the request an earlier try of it made), wait
    for it, and answer as OpenAI's image routes do; ``uploads``: the images ``generate``
    names, decoded but not yet kept."""
    name = call.name
    svc.attend_call(who, name)
    try:
        if call.idempotency_key is not None:
            request_id = (svc.join_call(who, call.idempotency_key)
                          or svc.generate(who, generate, call.idempotency_key, uploads))
        else:
            joined = svc.join_call(who, name) if call.retry_count else None
            request_id = joined or svc.generate(who, generate, uploads=uploads)
            svc.remember_call(who, name, request_id)
    except BaseException:
        svc.leave_call(who, name)
        raise

    def gone() -> bool:
        return bool(anyio.from_thread.run(request.is_disconnected))

    record = _wait(svc, who, request_id, svc.settings.api.sync_timeout_s, gone,
                   call.asked.keep, name)
    if call.asked.response_format == "url":
        # OpenAI clients fetch the URL as given: it must be absolute.
        base = svc.settings.api.public_url or str(request.base_url)
        item = {"url": f"{base.rstrip('/')}/v1/requests/{request_id}/result"}
    else:
        _, data = svc.result(who, request_id)
        item = {"b64_json": base64.b64encode(data).decode()}
    # Extension: what approximate reuse did, as the status reports it.
    return {"created": int(record.created_at), "data": [item],
            "reuse": reuse_status(record).model_dump(mode="json")}


def _model(served: ServedModel) -> ModelObject:
    card = served.card

    def size(w: int | None, h: int | None) -> str | None:
        return f"{w}x{h}" if w and h else None

    return ModelObject(id=model_ids(served)[0], created=0, owned_by="diffcache",
                       diffcache=ModelFacts(
                           family=served.family,
                           native_size=size(card.native_width, card.native_height),
                           max_size=size(card.max_width, card.max_height),
                           size_multiple=served.spatial_multiple,
                           workflows=sorted(served.limits.workflows), prompts=card.prompts,
                           defaults=asdict(served.defaults)))


@router.get("/v1/models", response_model=ModelList)
def models(_: Tenant, svc: Svc) -> ModelList:
    """OpenAI-compatible: the one model this deployment serves."""
    return ModelList(data=[_model(svc.served())])


@router.get("/v1/models/{model_id:path}", response_model=ModelObject)
def model(model_id: str, _: Tenant, svc: Svc) -> ModelObject:
    served = svc.served()
    check_model(model_id, served)
    return _model(served)

@router.post("/v1/videos", response_model=VideoJob)
def create_video(body: VideosBody, who: Tenant, svc: Svc) -> VideoJob:
    """SGLang-compatible: queue a video and answer with its job."""
    width, height = _size(body.size)
    try:
        request_id = svc.generate(who, GenerateBody(
            prompt=body.prompt, negative_prompt=body.negative_prompt, width=width,
            height=height, num_frames=_frames(body, svc.served(), svc.settings.workers.fps),
            num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
            seed=body.seed, output_format=OutputFormat.MP4, loras=body.loras, reuse=body.reuse,
            image=body.input_reference))
    except (FieldError, UploadError) as exc:  # the image, named as this route names it
        if exc.field != "image":
            raise
        raise (FieldError("input_reference", exc.message) if isinstance(exc, FieldError)
               else UploadError("input_reference", exc.message, exc.status)) from None
    return video_job(svc.record(who, request_id))

@router.get("/v1/videos/{video_id}", response_model=VideoJob)
def get_video(video_id: str, who: Tenant, svc: Svc) -> VideoJob:
    return video_job(svc.record(who, video_id))

@router.get("/v1/videos/{video_id}/content")
def video_content(video_id: str, who: Tenant, svc: Svc) -> Response:
    record, data = svc.result(who, video_id)
    return Response(data, media_type="video/mp4", headers=reuse_headers(record))


POLL_S = 0.5  # how often an abandoned call is noticed


def _wait(svc: Service, tenant: str, request_id: str, timeout_s: float,
          gone: Callable[[], bool], keep: bool, call: str) -> RequestRecord:
    """The request once it is done, woken by its record's notifications. Abandoned (the
    client gone, or ``timeout_s`` passed), it is cancelled unless ``keep``, or another caller
    of the same call still waits on it (a retry that joined it)."""
    abandoned = False
    try:
        for record in svc.queue.follow(tenant, request_id, timeout_s, reread_s=POLL_S):
            if not record.state.terminal and gone():
                abandoned = True
                raise ClientGoneError(f"the client of request {request_id} went away")
    except TimeoutError as exc:
        abandoned = True
        raise WaitTimeoutError(
            f"request {request_id} did not finish within {timeout_s:.0f} s; "
            + ("poll /v1/requests/" + request_id if keep else "it was cancelled (set keep to "
               "let it run on); a retry of this call resumes it")) from exc
    finally:
        if svc.leave_call(tenant, call) <= 0 and abandoned and not keep:
            svc.queue.records.cancel(tenant, request_id)
    if record.state is not State.DONE:
        raise NotReadyError(record)
    return record
