"""The one wire style: every typed value that Redis keeps as JSON (a record's request and
warnings, the facts and statuses processes publish, adapter names) is written by one codec,
pydantic, in an envelope naming its kind and version. Reading validates (nothing is ever
unpickled); a payload of another kind or of a version this release cannot read is a typed
error naming both.

The queue's job messages keep their own flat ``v`` (``workers/queue/messages.py``): the Lua
scripts read it in the entry's header, and they raise the same ``UnknownVersionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json, to_json

T = TypeVar("T")

# Payloads written before they carried an envelope read as this version.
UNVERSIONED = 0


class WireError(ValueError):
    """Bytes that are not a readable payload of ``kind``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class UnknownVersionError(WireError):
    """A payload of a version this release does not read (written by a newer one, or by one
    so old that its reader is gone)."""

    def __init__(self, kind: str, version: object, readable: tuple[int, ...]) -> None:
        super().__init__(kind, f"version {version!r} is not one this release reads "
                               f"({', '.join(map(str, readable))})")
        self.version = version


class Wire(Generic[T]):
    """The codec of one kind of payload: ``encode`` writes the current ``version``;
    ``decode`` reads it, and each version of ``older`` through its own reader (which takes
    the decoded JSON), so values written by an earlier release and still held (records in
    flight, adapters) read after an upgrade."""

    def __init__(self, kind: str, shape: Any, version: int = 1,
                 older: Mapping[int, Callable[[Any], T]] | None = None) -> None:
        self.kind = kind
        self.version = version
        self._adapter: TypeAdapter[T] = TypeAdapter(shape)
        self._older = dict(older or {})

    def encode(self, value: T) -> bytes:
        return to_json({"kind": self.kind, "v": self.version,
                        "value": self._adapter.dump_python(value, mode="json")})

    def encode_str(self, value: T) -> str:
        return self.encode(value).decode()

    def decode(self, raw: str | bytes) -> T:
        try:
            found = from_json(raw)
        except ValueError as exc:
            raise WireError(self.kind, f"not JSON ({exc})") from exc
        if isinstance(found, dict) and found.keys() == {"kind", "v", "value"}:
            if found["kind"] != self.kind:
                raise WireError(self.kind, f"holds a {found['kind']!r} payload")
            version, value = found["v"], found["value"]
        else:
            version, value = UNVERSIONED, found
        if version == self.version:
            read: Callable[[Any], T] = self._adapter.validate_python
        elif version in self._older:
            read = self._older[version]
        else:
            raise UnknownVersionError(self.kind, version, (self.version, *self._older))
        try:
            return read(value)
        except (ValidationError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise WireError(self.kind, f"unreadable version {version} payload ({exc})") from exc
