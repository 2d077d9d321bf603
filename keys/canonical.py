"""Canonical byte encoding of key inputs and the xxh3-128 digest over it.

Keys must be identical across processes, machines and releases, so they are never built from
Python's ``hash``, ``repr`` or JSON of floats: every value is written as a tagged, length-prefixed
byte string whose layout is fixed here and pinned by golden vectors in the tests.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import xxhash

Canonical: TypeAlias = (
    bool | int | float | str | bytes | Sequence["Canonical"] | Mapping[str, "Canonical"] | None
)

# One tag byte per type. Changing a tag or a layout changes every key: bump KEY_VERSION instead.
_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _SEQ, _MAP = (bytes([c]) for c in b"NftifsbLM")


def _length(n: int) -> bytes:
    return struct.pack(">Q", n)


def _encode_into(value: Canonical, out: bytearray) -> None:
    # bool before int: bool is a subclass of int, and True must not collide with 1.
    if value is None:
        out += _NONE
    elif value is True:
        out += _TRUE
    elif value is False:
        out += _FALSE
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        out += _INT + _length(len(raw)) + raw
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN has no canonical form and cannot be part of a key")
        # Exact IEEE-754 bits: 0.1 and 0.1000000001 are different guidance values.
        out += _FLOAT + struct.pack(">d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += _STR + _length(len(raw)) + raw
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out += _BYTES + _length(len(raw)) + raw
    else:
        _encode_container(value, out)


def _encode_container(value: Canonical, out: bytearray) -> None:
    if isinstance(value, Mapping):
        # Sorted by key so that dict insertion order never changes a key.
        items = sorted(value.items(), key=lambda kv: kv[0].encode("utf-8"))
        out += _MAP + _length(len(items))
        for k, v in items:
            if not isinstance(k, str):
                raise TypeError(f"mapping keys must be str, got {type(k).__name__}")
            _encode_into(k, out)
            _encode_into(v, out)
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        out += _SEQ + _length(len(value))
        for item in value:
            _encode_into(item, out)
    else:
        raise TypeError(f"{type(value).__name__} has no canonical encoding")


def canonical_bytes(value: Canonical) -> bytes:
    """The canonical encoding of ``value``: equal values give equal bytes, and only they do."""
    out = bytearray()
    _encode_into(value, out)
    return bytes(out)


def digest(domain: str, value: Canonical) -> str:
    """xxh3-128 hex digest of ``value``, separated by ``domain`` so two kinds never collide."""
    return xxhash.xxh3_128_hexdigest(canonical_bytes([domain, value]))
