"""Typed errors of the cache service; each carries the key and operation it concerns.

A miss is never an error. ``StoreUnavailableError`` is retryable: a caller that can recompute
does so and counts it; a caller that cannot, retries or fails the request with this reason.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class; ``key`` and ``op`` say which entry and which operation failed."""

    retryable = False

    def __init__(self, message: str, *, key: str | None = None, op: str | None = None) -> None:
        context = ", ".join(f"{n}={v}" for n, v in (("op", op), ("key", key)) if v)
        super().__init__(f"{message} ({context})" if context else message)
        self.key = key
        self.op = op


class StoreUnavailableError(CacheError):
    """The store could not be reached or did not answer; the operation may succeed later."""

    retryable = True


class StoreFullError(CacheError):
    """No segment has room right now; eviction runs in the background, so a retry may fit."""

    retryable = True


class StoreOperationError(CacheError):
    """The store answered with an error that retrying will not fix."""

    def __init__(self, message: str, *, code: int, key: str | None = None,
                 op: str | None = None) -> None:
        super().__init__(f"{message}: mooncake code {code}", key=key, op=op)
        self.code = code


class EntryTooLargeError(CacheError):
    """An entry does not fit the buffer it was asked to land in."""


class CodecError(ValueError):
    """Bytes that are not a well-formed tensor entry (bad magic, version or lengths)."""


class UploadError(ValueError):
    """An upload (an adapter, an image) the service refuses; ``field`` names what is wrong,
    ``status`` the HTTP answer (413 for too large, else 422)."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status
