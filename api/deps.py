"""Request-scoped dependencies: the caller's tenant (from its API key) and the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from api.service import Service
from cachesvc.settings import Settings


def tenant(request: Request, authorization: Annotated[str | None, Header()] = None,
           x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The tenant an API key maps to; with no keys configured, the default tenant."""
    settings: Settings = request.app.state.settings
    keys = settings.api.api_keys
    if not keys:
        return settings.default_tenant
    key = x_api_key or (authorization or "").removeprefix("Bearer ").strip()
    if key not in keys:
        raise HTTPException(401, "a valid API key is required (Authorization: Bearer <key>)")
    return keys[key]


def service(request: Request) -> Service:
    svc: Service = request.app.state.service
    return svc


Tenant = Annotated[str, Depends(tenant)]
Svc = Annotated[Service, Depends(service)]
