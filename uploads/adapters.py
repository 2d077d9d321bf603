"""LoRA adapters as content: uploaded safetensors, validated against the served denoiser's
linear layers, stored soft-pinned in the store under their content hash, and named per tenant
in a Redis hash. Data read back is parsed as safetensors or JSON, never unpickled."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash
from pydantic import TypeAdapter

from cachesvc.errors import UploadError
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import RedisClient
from cachesvc.wire import UNVERSIONED, Wire
from keys import adapter_key
from keys.names import adapter_index

if TYPE_CHECKING:
    from cachesvc.byte_entries import ByteEntries

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LORA_KEY = re.compile(r"^transformer\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


class AdapterError(UploadError):
    """An adapter's upload or use the service refuses; ``field`` names what is wrong."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What ``GET /v1/adapters`` lists of one adapter."""

    name: str
    hash: str
    size: int
    rank: int
    targets: int  # linear layers it adapts


# Names outlive releases: those written before the envelope hold the same fields, bare.
_INFO: Wire[AdapterInfo] = Wire("adapter", AdapterInfo, older={
    UNVERSIONED: TypeAdapter(AdapterInfo).validate_python})


def _header(data: bytes) -> dict[str, dict[str, object]]:
    """The safetensors header (names, dtypes, shapes) without reading any tensor; AdapterError
    for anything else, a pickled checkpoint included."""
    if len(data) < 8:
        raise AdapterError("body", "not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise AdapterError("body", "not a safetensors file (pickled .bin/.pt checkpoints are "
                           "refused: they can run code when loaded)")
    try:
        header = json.loads(data[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError("body", "not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError("body", "not a safetensors file")
    header.pop("__metadata__", None)
    return header


def validate(data: bytes, linears: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
    """Check a LoRA in diffusers' format against the denoiser's linear layers (module name ->
    (out, in)); its rank and how many layers it adapts. The error names the first bad tensor."""
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, entry in sorted(_header(data).items()):
        match = _LORA_KEY.fullmatch(name)
        if match is None:
            raise AdapterError(name, "not a denoiser LoRA tensor; expected "
                               "transformer.<module>.lora_A.weight or .lora_B.weight (the "
                               "families' diffusers LoRA loaders adapt the transformer only, "
                               "so adapters for the text encoder are not supported)")
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) != 2:
            raise AdapterError(name, f"must be a 2-D matrix, not shape {shape}")
        pairs.setdefault(match["module"], {})[match["half"]] = shape
    if not pairs:
        raise AdapterError("body", "the file holds no LoRA tensors")
    ranks = set()
    for module, halves in pairs.items():
        if module not in linears:
            raise AdapterError(module, "the served denoiser has no linear layer of this name")
        if set(halves) != {"A", "B"}:
            raise AdapterError(module, "needs both lora_A and lora_B")
        out_features, in_features = linears[module]
        (rank, a_in), (b_out, b_rank) = halves["A"], halves["B"]
        if a_in != in_features or b_out != out_features or b_rank != rank:
            raise AdapterError(module, f"lora_A {halves['A']} and lora_B {halves['B']} do not "
                               f"fit a linear layer of {in_features} -> {out_features}")
        ranks.add(rank)
    return max(ranks), len(pairs)


class AdapterRegistry:
    """A tenant's adapters: bytes in the store, and on disk beside it (an adapter is uploaded,
    not computed: the store's copy is a cache of the file), names in Redis."""

    def __init__(self, cache: Callable[[], ByteEntries], client: RedisClient,
                 files_dir: Path) -> None:
        self._cache = cache  # the store client as it stands (the API connects it late)
        self.redis = client
        self.files = OutputFiles(files_dir, ttl_s=float("inf"))

    def add(self, tenant: str, name: str, data: bytes,
            linears: Mapping[str, tuple[int, int]]) -> AdapterInfo:
        if not NAME_RE.fullmatch(name):
            raise AdapterError("name", f"must match {NAME_RE.pattern}")
        rank, targets = validate(data, linears)
        info = AdapterInfo(name, xxhash.xxh3_128_hexdigest(data), len(data), rank, targets)
        self.files.write(adapter_key(tenant, info.hash), data)
        self._store(tenant, info.hash, data)
        self.redis.hset(adapter_index(tenant), name, _INFO.encode(info))
        return info

    def list(self, tenant: str) -> list[AdapterInfo]:
        raw: dict[bytes, bytes] = self.redis.hgetall(adapter_index(tenant))  # type: ignore[assignment]
        return sorted((_INFO.decode(v) for v in raw.values()), key=lambda a: a.name)

    def find(self, tenant: str, name: str | None = None,
             content_hash: str | None = None) -> AdapterInfo | None:
        """The tenant's adapter of that name, or of that hash; None if it has none."""
        return next((a for a in self.list(tenant)
                     if (name is not None and a.name == name)
                     or (content_hash is not None and a.hash == content_hash)), None)

    def ensure_stored(self, tenant: str, content_hash: str) -> None:
        """Put an adapter the store lost (evicted, or gone with a storage node) back from its
        file, before a request that names it reaches a worker."""
        key = adapter_key(tenant, content_hash)
        if self._cache().exists(key):
            return
        data = self.files.read(key)
        if data is None:
            raise AdapterError("loras", f"adapter {content_hash} is lost from the store and "
                               "from disk; upload it again")
        self._store(tenant, content_hash, data)

    def delete(self, tenant: str, name: str) -> bool:
        info = self.find(tenant, name=name)
        if info is None:
            return False
        self.redis.hdel(adapter_index(tenant), name)
        if self.find(tenant, content_hash=info.hash) is None:  # no other name holds it
            key = adapter_key(tenant, info.hash)
            self._cache().remove(key)
            self.files.path(key).unlink(missing_ok=True)
        return True

    def _store(self, tenant: str, content_hash: str, data: bytes) -> None:
        self._cache().write(adapter_key(tenant, content_hash), data)


def as_dict(info: AdapterInfo) -> dict[str, object]:
    return asdict(info)
