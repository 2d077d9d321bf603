"""One error body for every failure: what went wrong and, for bad input, which field."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

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
    @app.exception_handler(ValidationError)
    async def invalid(_: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
        # ValidationError: a body that a compatibility endpoint maps onto GenerateBody.
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path",
                                                                    "header"))
        limit = first.get("ctx")
        detail = f"{field}: {first['msg']}" + (f" ({limit})" if limit else "")
        return _body(422, detail, field or None)

    @app.exception_handler(FieldError)
    async def out_of_limits(_: Request, exc: FieldError) -> JSONResponse:
        return _body(422, str(exc), exc.field)

    # Exception type -> status, and whether the client should retry after a pause.
    table: dict[type[Exception], tuple[int, bool]] = {
        QueueFullError: (429, True), NotFoundError: (404, False), NotReadyError: (409, False),
        GoneError: (410, False), WaitTimeoutError: (504, False),
        StoreUnavailableError: (503, True), DurabilityError: (503, True)}

    async def mapped(_: Request, exc: Exception) -> JSONResponse:
        status, retry = table[type(exc)]
        return _body(status, str(exc),
                     headers={"Retry-After": str(retry_after_s)} if retry else None)

    for exc_type in table:
        app.add_exception_handler(exc_type, mapped)
