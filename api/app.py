"""The FastAPI app: routers, error bodies, the body size limit and connections."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from api import compat, dashboard, errors, routes
from api.metrics import ClusterCollector, registry_with
from api.schemas import ErrorBody
from api.service import Service
from cachesvc.connect import open_cache, open_redis
from cachesvc.settings import Settings

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (401, 404, 409, 410, 413, 422, 429, 503, 504)}


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = open_redis(settings)
        cache = open_cache(settings, client)
        app.state.service = Service(settings, client, cache)
        app.state.registry = registry_with(ClusterCollector(client))
        try:
            yield
        finally:
            cache.close()

    app = FastAPI(title="diffcache", version="0.1.0", lifespan=lifespan, responses=ERRORS)
    app.state.settings = settings
    errors.install(app, settings.api.retry_after_s)
    limit = settings.api.max_body_bytes

    @app.middleware("http")
    async def body_limit(request: Request,
                         call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return JSONResponse({"error": f"body is larger than {limit} bytes"},
                                status_code=413)
        return await call_next(request)

    app.include_router(routes.router)
    app.include_router(compat.router)
    app.include_router(dashboard.router)
    return app
