"""Self-describing tensor entries: a fixed binary header followed by the raw tensor bytes.

The header names magic, version, dtype, shape, payload length, an xxh3-64 checksum of the payload,
the measured cost of computing the entry and its expiry. Nothing here ever unpickles: reading an
entry is a ``struct`` parse plus a typed view of the bytes that follow. ``Layout`` is the header
as a spec fixes it, for sealing and checking entries of a known spec without parsing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from cachesvc.errors import CodecError

if TYPE_CHECKING:
    import torch

MAGIC = b"DCT\x00"
VERSION = 1
ALIGN = 64  # payload offset alignment, so typed views of any dtype are aligned
MAX_NDIM = 8

# '<': little-endian, no implicit padding.
# magic, version, dtype code, ndim, header size, payload bytes, checksum, cost us, expiry ms
_FIXED = struct.Struct("<4sHBBIQQQQ")
# The per-entry fields (checksum, cost, expiry) sit between what the spec fixes: the first
# 20 bytes, and the shape with its zero padding after the fixed part.
_PER_ENTRY = struct.Struct("<QQQ")
_PER_ENTRY_AT = 20

# dtype name -> (code in the header, bytes per element). By name, so that headers are read
# and written without torch: the API handles byte entries and never loads it.
_DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float64": (4, 8),
    "int64": (5, 8),
    "int32": (6, 4),
    "int16": (7, 2),
    "int8": (8, 1),
    "uint8": (9, 1),
    "bool": (10, 1),
}
_CODE_NAMES = {code: name for name, (code, _) in _DTYPES.items()}


def _unsupported(dtype: object) -> CodecError:
    return CodecError(f"unsupported dtype {dtype!r}; supported: {sorted(_DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise _unsupported(dtype)
    return name


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype and shape of a tensor: what a queue message carries instead of the tensor."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise _unsupported(self.dtype)
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise CodecError(f"shape {self.shape} must have <= {MAX_NDIM} non-negative dims")

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPES[self.dtype][1]

    @property
    def header_bytes(self) -> int:
        return header_size(len(self.shape))

    @property
    def entry_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


@dataclass(frozen=True, slots=True)
class Header:
    spec: TensorSpec
    size: int
    payload_bytes: int
    checksum: int
    cost_us: int
    expires_at_ms: int

    @property
    def entry_bytes(self) -> int:
        return self.size + self.payload_bytes


def header_size(ndim: int) -> int:
    raw = _FIXED.size + 8 * ndim
    return -(-raw // ALIGN) * ALIGN


def checksum(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class Checksum:
    """``checksum`` of a payload fed in consecutive pieces; the same value as in one call."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, piece: memoryview) -> None:
        self._state.update(piece)

    @property
    def value(self) -> int:
        return self._state.intdigest()


def write_header(buf: memoryview, spec: TensorSpec, *, checksum: int, cost_us: int,
                 expires_at_ms: int) -> int:
    """Write the header for ``spec`` at the start of ``buf``; returns the header size."""
    size = spec.header_bytes
    ndim = len(spec.shape)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, _DTYPES[spec.dtype][0], ndim, size,
                     spec.payload_bytes, checksum, cost_us, expires_at_ms)
    struct.pack_into(f"<{ndim}Q", buf, _FIXED.size, *spec.shape)
    buf[_FIXED.size + 8 * ndim:size] = bytes(size - _FIXED.size - 8 * ndim)
    return size


def parse_header(buf: memoryview) -> Header:
    """Parse and validate the header at the start of ``buf``, whose entry size is not known
    yet (a read sized from what the caller expects); ``read_header`` when it is."""
    if len(buf) < _FIXED.size:
        raise CodecError(f"entry of {len(buf)} bytes is shorter than a header")
    magic, version, code, ndim, size, payload, csum, cost_us, expires = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}")
    if version != VERSION:
        raise CodecError(f"unsupported entry version {version}")
    if code not in _CODE_NAMES or ndim > MAX_NDIM or size != header_size(ndim) or size > len(buf):
        raise CodecError(f"malformed header (dtype code {code}, ndim {ndim}, size {size})")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    spec = TensorSpec(_CODE_NAMES[code], shape)
    if payload != spec.payload_bytes:
        raise CodecError(f"lengths disagree: header says {payload} payload bytes for {spec}")
    return Header(spec, size, payload, csum, cost_us, expires)


def read_header(buf: memoryview, entry_size: int) -> Header:
    """Parse and validate the header of an entry of ``entry_size`` bytes held in ``buf``."""
    header = parse_header(buf[:entry_size])
    if header.entry_bytes != entry_size:
        raise CodecError(
            f"lengths disagree: header says {header.payload_bytes} payload bytes for "
            f"{header.spec}, entry holds {entry_size - header.size}"
        )
    return header


@dataclass(frozen=True, slots=True)
class Layout:
    """The header bytes that ``spec`` alone fixes. An entry of ``spec`` is sealed by copying
    them and packing three numbers, and a read that expects ``spec`` checks its header with two
    byte comparisons: after a transfer's wait, with caches gone cold, parsing costs far more."""

    spec: TensorSpec
    template: bytes
    fixed_head: bytes  # magic, version, dtype, ndim, header size, payload length
    fixed_tail: bytes  # shape and padding

    @classmethod
    def of(cls, spec: TensorSpec) -> Layout:
        template = bytearray(spec.header_bytes)
        write_header(memoryview(template), spec, checksum=0, cost_us=0, expires_at_ms=0)
        return cls(spec, bytes(template), bytes(template[:_PER_ENTRY_AT]),
                   bytes(template[_FIXED.size:]))

    def write(self, buf: memoryview, *, checksum: int, cost_us: int, expires_at_ms: int) -> None:
        """Write this layout's header, with these per-entry fields, at the start of ``buf``."""
        buf[:len(self.template)] = self.template
        _PER_ENTRY.pack_into(buf, _PER_ENTRY_AT, checksum, cost_us, expires_at_ms)

    def header(self, buf: memoryview) -> Header | None:
        """The header at the start of ``buf`` if it is one of this layout's, else None (the
        bytes may still be a valid header of another spec: ``parse_header`` decides)."""
        size = len(self.template)
        if buf[:_PER_ENTRY_AT] != self.fixed_head or buf[_FIXED.size:size] != self.fixed_tail:
            return None
        csum, cost_us, expires = _PER_ENTRY.unpack_from(buf, _PER_ENTRY_AT)
        return Header(self.spec, size, self.spec.payload_bytes, csum, cost_us, expires)
