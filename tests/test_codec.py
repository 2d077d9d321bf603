"""The entry format rejects anything it did not write, and round-trips everything it did."""

from __future__ import annotations

import pytest
import torch

from cachesvc import codec
from cachesvc.codec import TensorSpec
from cachesvc.errors import CodecError


def encode(tensor: torch.Tensor) -> bytearray:
    spec = TensorSpec.of(tensor)
    buf = bytearray(spec.entry_bytes)
    view = memoryview(buf)
    payload = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    view[spec.header_bytes:] = payload
    codec.write_header(view, spec, checksum=codec.checksum(view[spec.header_bytes:]),
                       cost_us=5, expires_at_ms=0)
    return buf


def test_header_round_trip() -> None:
    t = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    buf = encode(t)
    header = codec.read_header(memoryview(buf), len(buf))
    assert header.spec == TensorSpec("int64", (2, 3, 4))
    assert header.size % codec.ALIGN == 0 and header.cost_us == 5


@pytest.mark.parametrize("offset, value", [(0, 0x58), (4, 9), (6, 77), (7, 9)])
def test_malformed_headers_are_rejected(offset: int, value: int) -> None:
    buf = encode(torch.zeros(3))
    buf[offset] = value
    with pytest.raises(CodecError):
        codec.read_header(memoryview(buf), len(buf))


def test_truncated_entry_is_rejected() -> None:
    buf = encode(torch.zeros(16))
    with pytest.raises(CodecError, match="lengths disagree"):
        codec.read_header(memoryview(buf), len(buf) - 4)


def test_unsupported_dtype_names_the_supported_ones() -> None:
    with pytest.raises(CodecError, match="supported"):
        TensorSpec.of(torch.zeros(2, dtype=torch.complex64))
