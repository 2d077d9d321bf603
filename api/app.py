"""The FastAPI app: routers, error bodies, the body size limit and connections."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import adapters, compat, dashboard, errors, images, routes
from api.metrics import ClusterCollector, registry_with, tenant_labeller
from api.schemas import ErrorBody
from api.service import Service
from cachesvc.cache_link import CacheLink
from cachesvc.redis_client import open_redis
from config.settings import Settings

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (401, 403, 404, 409, 410, 413, 422, 429, 503, 504)}


class BodyTooLargeError(HTTPException):
    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(413, f"body is larger than {limit} bytes ({setting})")


# Paths whose bodies have a limit of their own: uploads are files, not JSON.
ADAPTER_UPLOADS = "/v1/adapters"


class BodyLimit:
    """Answers 413 once a request body passes ``limit`` bytes, however it is framed.

    A declared Content-Length is checked before the app runs. A chunked body declares nothing,
    so its bytes are counted as the app receives them, and the read that passes the limit
    raises, which the app's HTTPException handler turns into the error body.
    """

    def __init__(self, app: ASGIApp, limit: int, uploads: dict[str, tuple[int, str]]) -> None:
        self.app = app
        self.limits = (limit, "api.max_body_bytes")
        self.uploads = uploads  # path -> (limit, the setting that sets it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.uploads.get(scope["path"], self.limits)
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self._refuse(scope, receive, send, limit, setting)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(limit, setting)
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyTooLargeError:
            # Read outside FastAPI's body parsing (its handlers never saw it): answer here.
            if started:
                raise
            await self._refuse(scope, receive, send, limit, setting)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, limit: int,
                      setting: str) -> None:
        error = BodyTooLargeError(limit, setting)
        await JSONResponse(errors.error_content(scope["path"], 413, str(error.detail)),
                           status_code=413)(scope, receive, send)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = open_redis(settings)
        store = CacheLink(settings, client)  # connects while the API already serves
        app.state.service = service = Service(settings, client, store)
        app.state.registry = registry_with(ClusterCollector(service.queue.view,
                                                            tenant_labeller(settings.api)))
        try:
            yield
        finally:
            service.queue.close()
            store.close()

    app = FastAPI(title="diffcache", version="0.1.0", lifespan=lifespan, responses=ERRORS)
    app.state.settings = settings
    errors.install(app, settings.api.retry_after_s)
    app.add_middleware(BodyLimit, limit=settings.api.max_body_bytes, uploads={
        ADAPTER_UPLOADS: (settings.api.max_adapter_bytes, "api.max_adapter_bytes"),
        images.UPLOADS: (settings.api.max_image_bytes, "api.max_image_bytes"),
        # An image and a few form fields: its own bound applies to the image once read.
        compat.EDITS: (settings.api.max_image_bytes + settings.api.max_body_bytes,
                       "api.max_image_bytes + api.max_body_bytes")})
    app.include_router(routes.router)
    app.include_router(adapters.router)
    app.include_router(images.router)
    app.include_router(compat.router)
    app.include_router(dashboard.router)
    return app
