"""One error body for every failure: what went wrong and, for bad input, which field."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.schemas import FieldError
from api.service import (
    GoneError,
    NotFoundError,
    NotReadyError,
    QueueFullError,
    WaitTimeoutError,
)
from cachesvc.errors import StoreUnavailableError
from workers.submit import DurabilityError


def _body(status: int, error: str, field: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    content: dict[str, object] = {"error": error}
    if field is not None:
        content["field"] = field
    return JSONResponse(content, status_code=status, headers=headers)


def install(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path",
                                                                    "header"))
        limit = first.get("ctx")
        detail = f"{field}: {first['msg']}" + (f" ({limit})" if limit else "")
        return _body(422, detail, field or None)

    @app.exception_handler(FieldError)
    async def out_of_limits(_: Request, exc: FieldError) -> JSONResponse:
        return _body(422, str(exc), exc.field)

    @app.exception_handler(QueueFullError)
    async def full(_: Request, exc: QueueFullError) -> JSONResponse:
        return _body(429, str(exc), headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(NotFoundError)
    async def missing(_: Request, exc: NotFoundError) -> JSONResponse:
        return _body(404, str(exc))

    @app.exception_handler(NotReadyError)
    async def not_ready(_: Request, exc: NotReadyError) -> JSONResponse:
        return _body(409, str(exc))

    @app.exception_handler(GoneError)
    async def gone(_: Request, exc: GoneError) -> JSONResponse:
        return _body(410, str(exc))

    @app.exception_handler(WaitTimeoutError)
    async def too_slow(_: Request, exc: WaitTimeoutError) -> JSONResponse:
        return _body(504, str(exc))

    @app.exception_handler(StoreUnavailableError)
    async def store_down(_: Request, exc: StoreUnavailableError) -> JSONResponse:
        return _body(503, str(exc), headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(DurabilityError)
    async def not_durable(_: Request, exc: DurabilityError) -> JSONResponse:
        return _body(503, str(exc), headers={"Retry-After": str(retry_after_s)})
