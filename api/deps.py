"""Request-scoped dependencies: who the caller is (a tenant, from its API key, or an admin) and
the service."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from api.service import Service
from config.settings import Settings

_MISSING = "a valid API key is required (X-API-Key: <key> or Authorization: Bearer <key>)"


def _key(authorization: str | None, x_api_key: str | None) -> str:
    return x_api_key or (authorization or "").removeprefix("Bearer ").strip()


def _matches(key: str, candidates: list[str]) -> str | None:
    # Compares with every candidate in constant time, so timing does not reveal a key's prefix.
    found = None
    for candidate in candidates:
        if hmac.compare_digest(key.encode(), candidate.encode()):
            found = candidate
    return found


def _unauthorized() -> HTTPException:
    return HTTPException(401, _MISSING, headers={"WWW-Authenticate": "Bearer"})


def tenant(request: Request, authorization: Annotated[str | None, Header()] = None,
           x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The tenant an API key maps to; with no keys configured, the default tenant."""
    settings: Settings = request.app.state.settings
    api = settings.api
    if not api.authenticated:
        return settings.default_tenant
    key = _key(authorization, x_api_key)
    if (match := _matches(key, list(api.api_keys))) is not None:
        return api.api_keys[match]
    if _matches(key, api.admin_keys) is not None:
        raise HTTPException(403, "an admin key reads the dashboard only; requests belong to a "
                            "tenant, so use that tenant's key")
    raise _unauthorized()


def visible_tenants(request: Request, authorization: Annotated[str | None, Header()] = None,
                    x_api_key: Annotated[str | None, Header()] = None) -> list[str] | None:
    """The tenants whose rows the caller may read: None for all of them (an admin key, or no
    keys configured), else the one its key maps to."""
    api = request.app.state.settings.api
    if not api.authenticated:
        return None
    key = _key(authorization, x_api_key)
    if _matches(key, api.admin_keys) is not None:
        return None
    if (match := _matches(key, list(api.api_keys))) is not None:
        return [api.api_keys[match]]
    raise _unauthorized()


def service(request: Request) -> Service:
    svc: Service = request.app.state.service
    return svc


Tenant = Annotated[str, Depends(tenant)]
Viewer = Annotated[list[str] | None, Depends(visible_tenants)]
Svc = Annotated[Service, Depends(service)]
