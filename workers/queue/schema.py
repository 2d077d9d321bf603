"""The request record's schema: its states and the transitions between them, and the name of
every field it holds. Records are Redis hashes; the Lua scripts that change them get their state
names, state sets and field names generated from here (``script_library.py``), never typed by
hand."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from pydantic import TypeAdapter

from cachesvc.wire import UNVERSIONED, Wire
from keys import GenerationSpec, KeyKind
from workers.queue.messages import Stage
from workers.queue.spec_json import spec_from_json

# What the model card warns of a request (``Field.WARNINGS``); records from before the
# envelope hold the bare list.
WARNINGS: Wire[tuple[str, ...]] = Wire("warnings", tuple[str, ...], older={
    UNVERSIONED: TypeAdapter(tuple[str, ...]).validate_python})


def timestamp() -> str:
    """A record's time fields: unix seconds to the millisecond."""
    return f"{time.time():.3f}"


class State(StrEnum):
    """The life of a request; every change is written to its record."""

    QUEUED = "QUEUED"
    ENCODING = "ENCODING"
    ENCODED = "ENCODED"
    DENOISING = "DENOISING"
    DENOISED = "DENOISED"
    DECODING = "DECODING"
    PREEMPTED = "PREEMPTED"  # parked at a checkpoint until ``POST /v1/resume``
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def resumable(self) -> bool:
        return self in RESUMABLE

    @staticmethod
    def running(stage: Stage) -> State:
        """The state a stage moves its request into when it claims the job."""
        return _RUNNING[stage]

    @staticmethod
    def finished(stage: Stage) -> State:
        """The state a stage leaves its request in when it publishes."""
        return _FINISHED[stage]

    @staticmethod
    def waiting_for(stage: Stage) -> State:
        """The state of a request whose job waits in ``stage``'s stream."""
        return State.QUEUED if stage.previous is None else _FINISHED[stage.previous]


_RUNNING = {Stage.ENCODE: State.ENCODING, Stage.DENOISE: State.DENOISING,
            Stage.DECODE: State.DECODING}
_FINISHED = {Stage.ENCODE: State.ENCODED, Stage.DENOISE: State.DENOISED,
             Stage.DECODE: State.DONE}

TERMINAL = frozenset({State.DONE, State.FAILED, State.CANCELLED})
RESUMABLE = frozenset({State.PREEMPTED, State.FAILED, State.CANCELLED})
# Requests in these states hold neither an admission slot nor a decode credit: both are given
# back lazily by whoever next finds such a holder.
IDLE = TERMINAL | {State.PREEMPTED}
# Every state may also move to itself (a redelivery claims a running stage again) and to
# CANCELLED or FAILED while it is not terminal.
_MOVES: Mapping[State, frozenset[State]] = {
    # A request whose output is already cached ends at encode.
    # Every running or waiting state may also go back to QUEUED: the watchdog re-queues a
    # request that has no live owner and no entry anyone will deliver (``watchdog.py``).
    State.QUEUED: frozenset({State.ENCODING}),
    State.ENCODING: frozenset({State.ENCODED, State.DONE, State.QUEUED}),
    State.ENCODED: frozenset({State.DENOISING, State.QUEUED}),
    # Re-queued (ENCODED), parked (PREEMPTED), or back to encode for lost embeddings (QUEUED).
    State.DENOISING: frozenset({State.DENOISED, State.ENCODED, State.PREEMPTED, State.QUEUED}),
    State.DENOISED: frozenset({State.DECODING, State.QUEUED}),
    # Back to denoise for lost latents (ENCODED).
    State.DECODING: frozenset({State.DONE, State.ENCODED, State.QUEUED}),
    State.PREEMPTED: frozenset({State.QUEUED}),  # resumed
    State.DONE: frozenset({State.QUEUED}),  # its output was lost: made again
    State.FAILED: frozenset({State.QUEUED}),  # resumed
    State.CANCELLED: frozenset({State.QUEUED}),  # resumed
}
TRANSITIONS: Mapping[State, frozenset[State]] = {
    state: moves | {state} | (frozenset() if state in TERMINAL
                              else frozenset({State.CANCELLED, State.FAILED}))
    for state, moves in _MOVES.items()
}


class Field(StrEnum):
    """Fields that each record holds at most once."""

    SPEC = "spec"  # the canonical request, JSON
    MODEL = "model"  # family/name of the model that serves it
    STATE = "state"
    GENERATION = "generation"  # raised by every re-queue, resume and recompute
    STEP = "step"  # denoise steps done
    STEPS = "steps"
    CREATED_AT = "created_at"
    UPDATED_AT = "updated_at"
    ERROR = "error"
    WAITING = "waiting"  # what a running stage waits for (a decode credit, the store)
    PREEMPT = "preempt"  # a preemption asked of the denoising worker: a PreemptMode
    OUTPUT_KEY = "output_key"
    # The step denoise last started from: a checkpoint's, or an image trajectory's first.
    RESUMED_FROM = "resumed_from"
    CHECKPOINT_STEP = "checkpoint_step"  # the latest checkpoint written
    STOPPED_MID_STEP = "stopped_mid_step"
    WARNINGS = "warnings"  # JSON list: what the request asks outside what the model learnt
    # An approximate hit (``ApproximateHit``): the request was rewritten at encode to start
    # from another request's checkpoint; its spec is the rewritten one.
    REUSED_FROM = "reused_from"
    REUSED_STEP = "reused_step"
    REUSED_SIMILARITY = "reused_similarity"
    # Followers of the record's events (``events.py``, through ``lua/watch.lua``): the hot
    # scripts announce a change only while it is above 0.
    WATCHERS = "watchers"
    # Counters, added to rather than set.
    PREEMPTIONS = "preemptions"
    RESUMES = "resumes"
    RECOMPUTES = "recomputes"
    RESCUES = "rescues"  # times the watchdog re-queued the request (each one is a bug report)
    FORWARDS = "forwards"  # transformer forward passes denoise ran
    CFG_REUSED = "cfg_reused"  # unconditional forwards replaced by the interval residual


class StageField(StrEnum):
    """Fields held once per stage, as ``<prefix>:<stage>``."""

    DONE = "done"  # the stage published for the current generation
    FENCE = "fence"  # the highest fencing token that claimed the stage
    ATTEMPT = "attempt"  # the delivery attempt that claimed it
    WORKER = "worker"  # the consumer that claimed it
    SECONDS = "seconds"  # how long the stage ran

    def of(self, stage: Stage) -> str:
        return f"{self.value}:{stage.value}"

    def parse(self, name: str) -> Stage | None:
        prefix = f"{self.value}:"
        return Stage(name.removeprefix(prefix)) if name.startswith(prefix) else None


class KindField(StrEnum):
    """Counters held once per cached kind (``embed``, ``cfg``, ``checkpoint``, ``output``), as
    ``<prefix>:<kind>``; what the cache counters export sums to these over the records."""

    LOOKUPS = "lookups"
    HITS = "hits"
    RECOMPUTED = "recomputed"  # entries of the kind lost and made again for this request

    def of(self, kind: KeyKind) -> str:
        return f"{self.value}:{kind.value}"


# Fields added to rather than set: they sum over every attempt, refused ones included.
COUNTERS = frozenset({Field.PREEMPTIONS, Field.RESUMES, Field.RECOMPUTES, Field.RESCUES,
                      Field.FORWARDS, Field.CFG_REUSED})


def is_counter(name: str) -> bool:
    return name in COUNTERS or name.partition(":")[0] in KindField.__members__.values()


CHECKPOINT_PREFIX = "ckpt"
# ``late:<counter>``: what attempts refused after the request ended still counted (their cache
# lookups, their forwards). Only the scripts write these; the record's own counters are final.
LATE_PREFIX = "late"


def checkpoint_field(step: int) -> str:
    """The field naming the store key of the checkpoint after ``step``."""
    return f"{CHECKPOINT_PREFIX}:{step}"


class PreemptMode(StrEnum):
    """The values of ``Field.PREEMPT``: what a preempted job does."""

    REQUEUE = "requeue"  # back to its stream, to resume on the next free worker
    PARK = "park"  # left PREEMPTED until ``POST /v1/resume``


@dataclass(frozen=True, slots=True)
class ApproximateHit:
    """What approximate reuse did to a request: the request (of the same tenant) whose first
    ``step`` steps it starts from, and how similar their prompts were."""

    source_request_id: str
    step: int
    similarity: float

    def fields(self) -> dict[str, str]:
        return {Field.REUSED_FROM: self.source_request_id, Field.REUSED_STEP: str(self.step),
                Field.REUSED_SIMILARITY: f"{self.similarity:.6f}"}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A record as read: typed accessors over its fields, which stay available for status
    pages."""

    spec: GenerationSpec
    state: State
    fields: Mapping[str, str]

    @classmethod
    def parse(cls, fields: Mapping[str, str]) -> RequestRecord:
        return cls(spec_from_json(fields[Field.SPEC]), State(fields[Field.STATE]), fields)

    def get(self, name: str) -> str | None:
        return self.fields.get(name)

    def counter(self, name: str) -> int:
        """A counter field (a ``Field``, or a ``KindField.of`` name); 0 if never written."""
        return int(self.fields.get(name, "0"))

    @property
    def step(self) -> int:
        return self.counter(Field.STEP)

    @property
    def generation(self) -> int:
        return self.counter(Field.GENERATION)

    @property
    def error(self) -> str | None:
        return self.get(Field.ERROR)

    @property
    def warnings(self) -> list[str]:
        raw = self.get(Field.WARNINGS)
        return list(WARNINGS.decode(raw)) if raw else []

    @property
    def approximate(self) -> ApproximateHit | None:
        source = self.get(Field.REUSED_FROM)
        if source is None:
            return None
        return ApproximateHit(source, self.counter(Field.REUSED_STEP),
                              float(self.fields[Field.REUSED_SIMILARITY]))

    @property
    def output_key(self) -> str | None:
        return self.get(Field.OUTPUT_KEY)

    @property
    def created_at(self) -> float:
        return float(self.fields[Field.CREATED_AT])

    @property
    def updated_at(self) -> float:
        return float(self.fields[Field.UPDATED_AT])

    def stage_seconds(self) -> dict[Stage, float]:
        out: dict[Stage, float] = {}
        for name, value in self.fields.items():
            stage = StageField.SECONDS.parse(name)
            if stage is not None:
                out[stage] = float(value)
        return out

    def done(self, stage: Stage) -> bool:
        return StageField.DONE.of(stage) in self.fields

    def per_kind(self, prefix: KindField, with_late: bool = False) -> dict[str, int]:
        """Kind -> the counter ``prefix`` holds for it (hits, lookups or recomputes); with
        ``with_late``, plus what attempts refused after the request ended added."""
        heads = [f"{prefix.value}:", *([f"{LATE_PREFIX}:{prefix.value}:"] if with_late else [])]
        out: dict[str, int] = {}
        for name, value in self.fields.items():
            for head in heads:
                if name.startswith(head):
                    kind = name.removeprefix(head)
                    out[kind] = out.get(kind, 0) + int(value)
        return out

    def late(self) -> dict[str, int]:
        """Counter -> what attempts refused after the request ended still counted."""
        head = f"{LATE_PREFIX}:"
        return {k.removeprefix(head): int(v) for k, v in self.fields.items()
                if k.startswith(head)}

    def hits(self) -> dict[str, int]:
        return self.per_kind(KindField.HITS)

    def recomputed(self) -> dict[str, int]:
        """Kind -> how many times a lost entry of that kind was made again for this request."""
        return self.per_kind(KindField.RECOMPUTED)

    def checkpoints(self) -> dict[int, str]:
        """Step -> store key of every checkpoint this request wrote or started from."""
        head = f"{CHECKPOINT_PREFIX}:"
        return {int(k.removeprefix(head)): v for k, v in self.fields.items()
                if k.startswith(head)}
