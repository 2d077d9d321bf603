"""Self-describing tensor entries: a fixed binary header followed by the raw tensor bytes.

The header names magic, version, dtype, shape, payload length, an xxh3-64 checksum of the payload,
the measured cost of computing the entry and its expiry. Nothing here ever unpickles: reading an
entry is a ``struct`` parse plus a typed view of the bytes that follow.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from cachesvc.errors import CodecError

MAGIC = b"DCT\x00"
VERSION = 1
ALIGN = 64  # payload offset alignment, so typed views of any dtype are aligned
MAX_NDIM = 8

# '<': little-endian, no implicit padding.
# magic, version, dtype code, ndim, header size, payload bytes, checksum, cost us, expiry ms
_FIXED = struct.Struct("<4sHBBIQQQQ")

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _DTYPE_CODES}


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.float32`` for ``"float32"``; raises CodecError for dtypes entries cannot hold."""
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_CODES:
        raise CodecError(f"unsupported dtype {dtype}; supported: {sorted(_DTYPE_NAMES)}")
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype and shape of a tensor: what a queue message carries instead of the tensor."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise CodecError(f"shape {self.shape} must have <= {MAX_NDIM} non-negative dims")

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.torch_dtype.itemsize

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
    checksum: int
    cost_us: int
    expires_at_ms: int


def header_size(ndim: int) -> int:
    raw = _FIXED.size + 8 * ndim
    return -(-raw // ALIGN) * ALIGN


def checksum(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(buf: memoryview, spec: TensorSpec, *, checksum: int, cost_us: int,
                 expires_at_ms: int) -> int:
    """Write the header for ``spec`` at the start of ``buf``; returns the header size."""
    size = spec.header_bytes
    ndim = len(spec.shape)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, _DTYPE_CODES[spec.torch_dtype], ndim, size,
                     spec.payload_bytes, checksum, cost_us, expires_at_ms)
    struct.pack_into(f"<{ndim}Q", buf, _FIXED.size, *spec.shape)
    buf[_FIXED.size + 8 * ndim:size] = bytes(size - _FIXED.size - 8 * ndim)
    return size


def read_header(buf: memoryview, entry_size: int) -> Header:
    """Parse and validate the header of an entry of ``entry_size`` bytes held in ``buf``."""
    if entry_size < _FIXED.size:
        raise CodecError(f"entry of {entry_size} bytes is shorter than a header")
    magic, version, code, ndim, size, payload, csum, cost_us, expires = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}")
    if version != VERSION:
        raise CodecError(f"unsupported entry version {version}")
    if code not in _CODE_DTYPES or ndim > MAX_NDIM or size != header_size(ndim):
        raise CodecError(f"malformed header (dtype code {code}, ndim {ndim}, size {size})")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    spec = TensorSpec(dtype_name(_CODE_DTYPES[code]), tuple(shape))
    if payload != spec.payload_bytes or size + payload != entry_size:
        raise CodecError(
            f"lengths disagree: header says {payload} payload bytes for {spec}, "
            f"entry holds {entry_size - size}"
        )
    return Header(spec, size, csum, cost_us, expires)


def typed_view(raw: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec`` viewing the uint8 tensor ``raw`` from ``offset``; no copy."""
    flat = raw[offset:offset + spec.payload_bytes]
    return flat.view(spec.torch_dtype).view(spec.shape)
