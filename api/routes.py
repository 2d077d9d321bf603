"""The native endpoints: generate, status, progress events, result, cancel, preempt, resume,
health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from admission.body import GenerateBody, ResumeBody
from api.deps import Svc, Tenant
from api.schemas import Accepted, PreemptBody, Readiness, RequestStatus
from api.service import Service, reuse_headers, status_of

router = APIRouter()


@router.post("/v1/generate", status_code=202, response_model=Accepted)
def generate(body: GenerateBody, who: Tenant, svc: Svc,
             idempotency_key: Annotated[str | None, Header(max_length=256)] = None) -> Accepted:
    """Queue a generation; the 202 comes after the request is durable."""
    return accepted(svc, who, svc.generate(who, body, idempotency_key))


def accepted(svc: Service, tenant: str, request_id: str) -> Accepted:
    return Accepted(id=request_id, status_url=f"/v1/requests/{request_id}",
                    result_url=f"/v1/requests/{request_id}/result",
                    warnings=svc.record(tenant, request_id).warnings)


@router.get("/v1/requests/{request_id}", response_model=RequestStatus)
def status(request_id: str, who: Tenant, svc: Svc) -> RequestStatus:
    """State, step k of N, per-stage seconds, cache hits and the error if any."""
    return status_of(svc.record(who, request_id))


@router.get("/v1/requests/{request_id}/result")
def result(request_id: str, who: Tenant, svc: Svc) -> Response:
    """The output file; 409 while the request is not done."""
    record, data = svc.result(who, request_id)
    fmt = record.spec.output_format
    return Response(data, media_type=fmt.content_type, headers={
        "Content-Disposition": f'inline; filename="{request_id}.{fmt.value}"',
        **reuse_headers(record)})



@router.delete("/v1/requests/{request_id}", status_code=202, response_model=RequestStatus)
def cancel(request_id: str, who: Tenant, svc: Svc) -> RequestStatus:
    """Cancel; workers stop at the next step boundary."""
    return status_of(svc.cancel(who, request_id))


@router.post("/v1/requests/{request_id}/preempt", status_code=202,
             response_model=RequestStatus)
def preempt(request_id: str, who: Tenant, svc: Svc,
            body: PreemptBody | None = None) -> RequestStatus:
    """Checkpoint at the next step boundary and step aside: re-queue (default) or park."""
    return status_of(svc.preempt(who, request_id, (body or PreemptBody()).mode))


@router.post("/v1/resume", status_code=202, response_model=Accepted)
def resume(body: ResumeBody, who: Tenant, svc: Svc) -> Accepted:
    """Without overrides: continue a preempted, cancelled or failed request from its latest
    checkpoint (same id). With overrides: a new request branched from ``from_step``."""
    return accepted(svc, who, svc.resume(who, body))


@router.get("/v1/requests/{request_id}/events")
async def events(request_id: str, who: Tenant, svc: Svc) -> StreamingResponse:
    """Server-sent events with the request's state and step, until it finishes."""
    await asyncio.to_thread(svc.record, who, request_id)  # a 404 before the stream opens

    async def stream() -> AsyncIterator[str]:
        # Woken by the record's notifications; the fallback reread bounds what a lost one
        # costs, and what an idle stream costs Redis.
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        events = svc.queue.events
        with events.watching(who, request_id, lambda: loop.call_soon_threadsafe(changed.set)):
            last = None
            while True:
                changed.clear()
                record = await asyncio.to_thread(svc.record, who, request_id)
                now = status_of(record)
                if (now.state, now.step) != last:
                    last = (now.state, now.step)
                    yield f"event: progress\ndata: {now.model_dump_json()}\n\n"
                if record.state.terminal:
                    yield f"event: end\ndata: {json.dumps({'state': now.state})}\n\n"
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), events.fallback_s)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness)
def readyz(svc: Svc) -> JSONResponse:
    """Redis answers, the store takes a put and a get, every stage has a worker whose
    heartbeat is recent, and no supervised process is crash-looping."""
    ready = svc.readiness()
    return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    """Prometheus text: cluster-wide cache counters, queue depths and stage latencies."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
