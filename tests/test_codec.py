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


def test_a_layout_reads_the_headers_of_its_spec_as_read_header_does() -> None:
    t = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    buf = encode(t)
    layout = codec.Layout.of(TensorSpec.of(t))
    assert layout.header(memoryview(buf)) == codec.read_header(memoryview(buf), len(buf))


@pytest.mark.parametrize("other", [
    torch.zeros(3, 2),  # same dtype and size, other shape
    torch.zeros(2, 3, dtype=torch.int32),  # same shape and size, other dtype
    torch.zeros(2, 4),  # other size
])
def test_a_layout_refuses_headers_of_another_spec(other: torch.Tensor) -> None:
    layout = codec.Layout.of(TensorSpec("float32", (2, 3)))
    assert layout.header(memoryview(encode(other))) is None


@pytest.mark.parametrize("offset", [0, 5, 6, 7, 8, 12, 44])
def test_a_layout_refuses_its_own_header_with_a_byte_changed(offset: int) -> None:
    """Every byte the spec fixes is compared: magic, version, dtype, ndim, sizes, shape."""
    t = torch.zeros(2, 3)
    buf = encode(t)
    buf[offset] ^= 0xFF
    assert codec.Layout.of(TensorSpec.of(t)).header(memoryview(buf)) is None


def test_parse_header_reads_a_prefix_and_rejects_one_too_short_for_its_shape() -> None:
    buf = encode(torch.zeros(2, 3, 4, 5))  # four dims: a 128-byte header
    header = codec.parse_header(memoryview(buf)[:200])
    assert header.entry_bytes == len(buf) and header.spec == TensorSpec("float32", (2, 3, 4, 5))
    with pytest.raises(CodecError, match="malformed"):
        codec.parse_header(memoryview(buf)[:100])


def test_the_checksum_covers_every_payload_byte() -> None:
    payload = bytearray(torch.randn(1000).numpy().tobytes())
    base = codec.checksum(memoryview(payload))
    for i in (0, 1, len(payload) // 2, len(payload) - 1):
        payload[i] ^= 1
        assert codec.checksum(memoryview(payload)) != base
        payload[i] ^= 1
