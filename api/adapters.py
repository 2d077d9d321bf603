"""``/v1/adapters``: upload, list and delete a tenant's LoRA adapters. An upload is the raw
safetensors file as the body (``?name=``), validated against the served denoiser's layers."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from admission.request import NotFoundError
from api.deps import Svc, Tenant
from api.schemas import AdapterOut
from uploads.adapters import NAME_RE, as_dict

router = APIRouter()


@router.post("/v1/adapters", status_code=201, response_model=AdapterOut)
async def upload(request: Request, name: Annotated[str, Query(pattern=NAME_RE.pattern)],
                 who: Tenant, svc: Svc) -> AdapterOut:
    """Store a LoRA (safetensors in diffusers' format; pickles are refused) under ``name``."""
    data = await request.body()
    info = svc.add_adapter(who, name, data)
    return AdapterOut(**as_dict(info))


@router.get("/v1/adapters", response_model=list[AdapterOut])
def listed(who: Tenant, svc: Svc) -> list[AdapterOut]:
    """The caller's adapters, by name."""
    return [AdapterOut(**as_dict(a)) for a in svc.adapters.list(who)]


@router.delete("/v1/adapters/{name}", status_code=204)
def delete(name: str, who: Tenant, svc: Svc) -> None:
    """Forget an adapter; requests already accepted that use it fail if it is not loaded."""
    if not svc.adapters.delete(who, name):
        raise NotFoundError(f"no adapter {name}")
