"""One error body for every failure, ``{"error": ..., "field": ...}``: what went wrong and, for
bad input, which field. Routing errors, outages of Redis and the store, and unexpected errors
get it too, so a client never has to parse plain text."""

from __future__ import annotations

from http import HTTPStatus

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import ClusterError, MovedError, RedisClusterException, TryAgainError
from starlette.exceptions import HTTPException

from admission.body import field_error
from admission.request import NotFoundError
from api.service import (
    ClientGoneError,
    GoneError,
    NoDenoiserError,
    RecomputingError,
    WaitTimeoutError,
)
from cachesvc.errors import StoreUnavailableError, UploadError
from workers.queue.admission import FieldError, QueueFullError, UnknownModelError
from workers.queue.client import NotReadyError, UnknownRequestError
from workers.queue.served_model import NotPublishedError
from workers.queue.submit import DurabilityError

# Routes that speak OpenAI's dialect answer errors in its shape, which its SDK turns into the
# exception's message: {"error": {"message", "type", "param", "code"}}.
OPENAI_PREFIXES = ("/v1/images", "/v1/videos", "/v1/models")
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
                 413: "invalid_request_error", 422: "invalid_request_error",
                 429: "rate_limit_error", 504: "timeout_error"}


def _code(status: int) -> str | None:
    """The status as an OpenAI-style code: ``not_found`` for 404; None for a non-standard
    status."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return None


def _body(request: Request, status: int, error: str, field: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_content(request.url.path, status, error, field),
                        status_code=status, headers=headers)


def error_content(path: str, status: int, error: str,
                  field: str | None = None) -> dict[str, object]:
    """The error body for a route at ``path``: OpenAI's shape on its routes, ours elsewhere."""
    content: dict[str, object]
    if path.startswith(OPENAI_PREFIXES):
        content = {"error": {"message": error, "param": field,
                             "type": _OPENAI_TYPES.get(status, "server_error"),
                             "code": _code(status)}}
    else:
        content = {"error": error}
        if field is not None:
            content["field"] = field
    return content


def install(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def invalid(request: Request,
                      exc: RequestValidationError | ValidationError) -> JSONResponse:
        # ValidationError: a body that a compatibility endpoint maps onto GenerateBody.
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # its loc holds a byte offset, not a field
            return _body(request, 422, f"body: is not valid JSON ({first['ctx']['error']} at "
                         f"byte {first['loc'][-1]})", "body")
        error = field_error(first)
        return _body(request, 422, str(error), error.field or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Routing raises these with the bare status phrase; say what was asked for instead.
        error = str(exc.detail)
        if error == HTTPStatus(exc.status_code).phrase:
            error = f"{error}: {request.method} {request.url.path}"
        return _body(request, exc.status_code, error, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette raises the exception again after this answer, so the server logs it.
        return _body(request, 500, f"internal error ({type(exc).__name__}); see the API's log")

    @app.exception_handler(FieldError)
    async def out_of_limits(request: Request, exc: FieldError) -> JSONResponse:
        return _body(request, 422, str(exc), exc.field)

    @app.exception_handler(UploadError)
    async def bad_upload(request: Request, exc: UploadError) -> JSONResponse:
        return _body(request, exc.status, str(exc), exc.field)

    # Exception type -> status, and whether the client should retry after a pause. Subclasses
    # map as their base does: redis-py's BusyLoadingError is a ConnectionError, for one.
    table: dict[type[Exception], tuple[int, bool]] = {
        QueueFullError: (429, True), NotFoundError: (404, False), NotReadyError: (409, False),
        ClientGoneError: (499, False),
        NoDenoiserError: (503, True), NotPublishedError: (503, True),
        UnknownModelError: (404, False), UnknownRequestError: (404, False),
        GoneError: (410, False), WaitTimeoutError: (504, False), RecomputingError: (503, True),
        StoreUnavailableError: (503, True), DurabilityError: (503, True),
        redis.ConnectionError: (503, True), redis.TimeoutError: (503, True),
        # A Redis Cluster between a master's loss and its replica's promotion.
        ClusterError: (503, True), TryAgainError: (503, True), MovedError: (503, True),
        RedisClusterException: (503, True)}

    async def mapped(request: Request, exc: Exception) -> JSONResponse:
        status, retry = next(table[t] for t in type(exc).__mro__ if t in table)
        error = str(exc)
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | ClusterError
                      | TryAgainError | MovedError | RedisClusterException):
            error = f"Redis is unreachable ({exc}); retry later"
        return _body(request, status, error,
                     headers={"Retry-After": str(retry_after_s)} if retry else None)

    for exc_type in table:
        app.add_exception_handler(exc_type, mapped)
