"""The cluster-wide index that approximate reuse searches: every request's pooled prompt vector,
durable in Redis (one stream per tenant and reuse bucket, so a restarted worker rebuilds what
it needs), searched in memory with faiss. Nothing is ever searched across buckets."""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from cachesvc.redis_client import RedisClient
from keys.names import reuse_vectors

log = logging.getLogger(__name__)

# A vector travels with an explicit header (magic, dimension) and never as a pickle.
_MAGIC = b"DCV1"
_HEADER = struct.Struct("<4sI")
# Below this many vectors a bucket is searched exactly (a flat inner product over all of
# them, under a millisecond); above it, through an inverted-file index (faiss' IVF) of
# sqrt(n) lists, of which a lookup reads ``_PROBES``: about 16 sqrt(n) vectors, so a lookup
# stays near a millisecond at a million. It may miss the nearest vector now and then (the
# bench reports how often): a cache lookup that misses costs time, never a result.
EXACT_BELOW = 50_000
_PROBES = 16
_PAGE = 10_000  # stream entries read per round trip when a bucket catches up


class ReuseIndexError(ValueError):
    """A stored vector that cannot be read; names the stream and entry."""


def encode_vector(vector: np.ndarray) -> bytes:
    v = np.ascontiguousarray(vector, dtype="<f4").reshape(-1)
    return _HEADER.pack(_MAGIC, v.size) + v.tobytes()


def decode_vector(data: bytes, where: str) -> np.ndarray:
    if len(data) < _HEADER.size:
        raise ReuseIndexError(f"{where}: {len(data)} bytes hold no vector header")
    magic, dim = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ReuseIndexError(f"{where}: header {magic!r}, not {_MAGIC!r}")
    if len(data) != _HEADER.size + 4 * dim:
        raise ReuseIndexError(f"{where}: {len(data)} bytes for a vector of {dim} floats")
    return np.frombuffer(data, dtype="<f4", offset=_HEADER.size).astype(np.float32)


@dataclass(frozen=True, slots=True)
class Neighbour:
    request_id: str
    similarity: float  # cosine of the two normalised vectors


@dataclass
class _Bucket:
    """One bucket's vectors as far as this process has read its stream."""

    dim: int
    last_id: str = "0-0"
    ids: list[str] = field(default_factory=list)
    chunks: list[np.ndarray] = field(default_factory=list)  # every vector, to retrain on
    index: Any = None  # faiss.IndexFlatIP, or faiss.IndexIVFFlat once the bucket is large
    trained_at: int = 0  # vectors the IVF index was trained on (0: flat)

    def add(self, ids: list[str], vectors: np.ndarray) -> None:
        if self.index is None:
            self.index = faiss.IndexFlatIP(self.dim)
        self.index.add(vectors)
        self.ids += ids
        self.chunks.append(vectors)
        # A flat index past the bound, or an IVF index whose lists grew fourfold since it
        # was trained, is rebuilt once from its own vectors: the cost is paid per growth step.
        if len(self.ids) >= EXACT_BELOW and len(self.ids) >= 4 * max(self.trained_at, 1):
            self._train()

    def _train(self) -> None:
        everything = np.concatenate(self.chunks)
        self.chunks = [everything]
        lists = int(np.sqrt(len(everything)))
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, lists, faiss.METRIC_INNER_PRODUCT)
        sample = everything[np.random.default_rng(0).permutation(len(everything))[:64 * lists]]
        ivf.train(sample)
        ivf.add(everything)
        ivf.nprobe = _PROBES
        self.index, self.trained_at = ivf, len(everything)

    def search(self, vector: np.ndarray, count: int) -> list[Neighbour]:
        if not self.ids:
            return []
        similarities, rows = self.index.search(vector.reshape(1, -1), min(count, len(self.ids)))
        return [Neighbour(self.ids[r], float(s))
                for s, r in zip(similarities[0], rows[0], strict=True) if r >= 0]


class ReuseIndex:
    """Register a request's vector in its bucket; find the nearest earlier requests."""

    def __init__(self, client: RedisClient, max_per_bucket: int = 1_000_000) -> None:
        self.redis = client
        self.max_per_bucket = max_per_bucket
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def register(self, tenant: str, bucket: str, request_id: str, vector: np.ndarray) -> None:
        """Durable at once; an index (this one or another worker's) reads it at its next
        lookup in the bucket. The oldest vectors of a full bucket are trimmed."""
        self.register_many([(tenant, bucket, request_id, vector)])

    def register_many(self, entries: Sequence[tuple[str, str, str, np.ndarray]]) -> None:
        """``register`` for (tenant, bucket, request id, vector) entries, in one round trip
        (a bulk load)."""
        pipe = self.redis.pipeline(transaction=False)
        for tenant, bucket, request_id, vector in entries:
            pipe.xadd(reuse_vectors(tenant, bucket),
                      {"id": request_id, "vector": encode_vector(vector)},
                      maxlen=self.max_per_bucket, approximate=True)
        pipe.execute()

    def nearest(self, tenant: str, bucket: str, vector: np.ndarray,
                count: int) -> list[Neighbour]:
        """Up to ``count`` registered requests of the bucket, most similar first."""
        key = reuse_vectors(tenant, bucket)
        vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        with self._lock:
            held = self._buckets.get(key)
            if held is None or held.dim != vector.size:
                held = self._buckets[key] = _Bucket(vector.size)
            self._catch_up(key, held)
            return held.search(vector, count)

    def _catch_up(self, key: str, held: _Bucket) -> None:
        while True:
            entries: Any = self.redis.xrange(key, min=f"({held.last_id}", count=_PAGE)
            if not entries:
                return
            ids, vectors = [], []
            for entry_id, fields in entries:
                where = f"{key} entry {entry_id.decode()}"
                try:
                    v = decode_vector(fields[b"vector"], where)
                    if v.size != held.dim:  # a bucket names its model: one encoder, one size
                        raise ReuseIndexError(f"{where}: {v.size} floats in a bucket of "
                                              f"{held.dim}")
                    request_id = fields[b"id"].decode()
                except (KeyError, UnicodeDecodeError, ReuseIndexError) as exc:
                    # Passed over for good: one bad entry must not stop the bucket.
                    log.warning("reuse index: %s skipped (%r)", where, exc)
                    continue
                ids.append(request_id)
                vectors.append(v)
            if ids:
                held.add(ids, np.stack(vectors))
            held.last_id = entries[-1][0].decode()
            if len(entries) < _PAGE:
                return
