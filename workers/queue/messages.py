"""Everything that crosses a process boundary through Redis, as frozen, versioned types.

A job carries references (store keys, dtypes, shapes), never tensors. It is encoded as JSON and
validated on the way back in: data read from Redis is never unpickled or trusted blindly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import TypeAdapter

from cachesvc.wire import UnknownVersionError
from keys import Priority

MESSAGE_VERSION = 1
# Delivery counts stay far below this, so a token orders by generation, then by attempt.
ATTEMPTS_PER_GENERATION = 1_000_000


class Stage(StrEnum):
    """The stages a request passes through, in order."""

    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"

    @property
    def next(self) -> Stage | None:
        return _NEXT[self]

    @property
    def previous(self) -> Stage | None:
        return _PREVIOUS[self]


# Looked up on every dispatch, so worked out once.
_ORDER = list(Stage)
_NEXT: dict[Stage, Stage | None] = dict(zip(_ORDER, [*_ORDER[1:], None], strict=True))
_PREVIOUS: dict[Stage, Stage | None] = dict(zip(_ORDER, [None, *_ORDER[:-1]], strict=True))


class Role(StrEnum):
    """What a referenced tensor is to the stage that reads it."""

    PROMPT = "prompt"  # a schedule segment's condition embedding
    NEGATIVE = "negative"  # a segment's unconditional (negative prompt) embedding
    LATENTS = "latents"  # the final latents, from denoise to decode
    IMAGE = "image"  # an input image's encoding, which image-to-image starts from
    MASK = "mask"  # an inpainting mask at the latents' size: where the steps repaint


@dataclass(frozen=True, slots=True)
class RefName:
    """A reference's role, and for conditions the schedule segment it belongs to."""

    role: Role
    segment: int | None = None

    def __str__(self) -> str:
        return self.role.value if self.segment is None else f"{self.role.value}:{self.segment}"

    @classmethod
    def parse(cls, text: str) -> RefName:
        role, _, segment = text.partition(":")
        return cls(Role(role), int(segment) if segment else None)


LATENTS = RefName(Role.LATENTS)
IMAGE = RefName(Role.IMAGE)
MASK = RefName(Role.MASK)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor in the store: what it is to the consumer, its key, dtype and shape.
    ``name`` is the wire form of a ``RefName``; code reads ``ref_name``."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: RefName, key: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        return cls(str(name), key, dtype, shape)

    @property
    def ref_name(self) -> RefName:
        return RefName.parse(self.name)


@dataclass(frozen=True, slots=True)
class Job:
    """One request's work for one stage."""

    request_id: str
    tenant: str
    stage: Stage
    refs: tuple[TensorRef, ...] = ()
    # The trajectory's last chain link, from denoise to decode: it names the output entry.
    chain_index: int = 0
    chain_head: str = ""
    priority: Priority = Priority.INTERACTIVE
    # Compute seconds already spent on this request's trajectory (denoise to decode): stored
    # with the output, so a later identical request counts them as saved.
    compute_s: float = 0.0
    # Raised each time the request is re-queued (preempted) or resumed, so every delivery of
    # the new entry outranks every delivery of the old one.
    generation: int = 0
    v: int = MESSAGE_VERSION

    def fence_token(self, attempt: int) -> int:
        """The fencing token of delivery ``attempt`` of this job: records accept writes from
        the highest token they have seen only."""
        return self.generation * ATTEMPTS_PER_GENERATION + attempt

    def handoff(self, stage: Stage, refs: tuple[TensorRef, ...], *, chain_index: int = 0,
                chain_head: str = "", compute_s: float = 0.0) -> Job:
        """The same request's job for the next stage, in the same class and generation."""
        return Job(self.request_id, self.tenant, stage, refs, chain_index, chain_head,
                   self.priority, compute_s, self.generation)

    def ref(self, name: RefName) -> TensorRef:
        for ref in self.refs:
            if ref.ref_name == name:
                return ref
        raise KeyError(f"job for {self.request_id} at {self.stage} has no input {name!r}")

    def to_json(self) -> str:
        return _JOB.dump_json(self).decode()

    @staticmethod
    def from_json(raw: str | bytes) -> Job:
        job = _JOB.validate_json(raw)
        if job.v != MESSAGE_VERSION:
            raise UnknownVersionError("job", job.v, (MESSAGE_VERSION,))
        return job


_JOB: TypeAdapter[Job] = TypeAdapter(Job)

