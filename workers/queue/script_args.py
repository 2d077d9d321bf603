"""The typed arguments of every script in ``lua/``: one frozen dataclass per file, whose fields
in order are the script's KEYS slots and then its ARGV slots, bound in Lua to locals of the same
names. ``tests/test_scripts.py`` checks each file's header names exactly these slots."""

from __future__ import annotations

from dataclasses import dataclass

from workers.queue.record_write import RecordWrite
from workers.queue.schema import State
from workers.queue.script_slots import ScriptArgs, arg, key


@dataclass(frozen=True, slots=True)
class ClaimArgs(ScriptArgs):
    NAME = "claim"
    record: str = key()
    stage: str = arg()
    token: int = arg()
    generation: int = arg()
    running: State = arg()
    now: str = arg()
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class TakeArgs(ScriptArgs):
    NAME = "take"
    streams: tuple[str, ...] = key(rest=True)
    group: str = arg()
    consumer: str = arg()
    count: int = arg()
    stage: str = arg()
    running: State = arg()
    now: str = arg()
    fields: RecordWrite = arg()


@dataclass(frozen=True, slots=True)
class UpdateArgs(ScriptArgs):
    NAME = "update"
    record: str = key()
    stage: str = arg()
    token: int = arg()
    now: str = arg()
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class PublishArgs(ScriptArgs):
    NAME = "publish"
    record: str = key()
    stream: str = key()
    next_stream: str = key()
    latency: str = key()
    stage: str = arg()
    token: int = arg()
    group: str = arg()
    entry_id: str = arg()
    next_job: str = arg()
    finished: State = arg()
    now: str = arg()
    bucket: str = arg()
    seconds: str = arg()
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class DeadLetterArgs(ScriptArgs):
    NAME = "dead_letter"
    record: str = key()
    stream: str = key()
    dead_letters: str = key()
    group: str = arg()
    entry_id: str = arg()
    job: str = arg()
    reason: str = arg()
    now: str = arg()
    generation: int = arg()


@dataclass(frozen=True, slots=True)
class CancelArgs(ScriptArgs):
    NAME = "cancel"
    record: str = key()
    now: str = arg()


@dataclass(frozen=True, slots=True)
class AskPreemptArgs(ScriptArgs):
    NAME = "ask_preempt"
    record: str = key()
    mode: str = arg()
    now: str = arg()


@dataclass(frozen=True, slots=True)
class RequeueArgs(ScriptArgs):
    NAME = "requeue"
    record: str = key()
    stream: str = key()
    requeue_stream: str = key()
    credits: str = key()
    stage: str = arg()
    token: int = arg()
    group: str = arg()
    entry_id: str = arg()
    job: str = arg()
    generation: int = arg()
    waiting: State = arg()
    now: str = arg()
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class RecomputeArgs(ScriptArgs):
    NAME = "recompute"
    record: str = key()
    stream: str = key()
    redo_stream: str = key()
    credits: str = key()
    stage: str = arg()
    token: int = arg()
    group: str = arg()
    entry_id: str = arg()
    job: str = arg()
    generation: int = arg()
    waiting: State = arg()
    now: str = arg()
    lost: str = arg()
    max_recomputes: int = arg()
    reason: str = arg()
    cleared: tuple[str, ...] = arg(table=True)


@dataclass(frozen=True, slots=True)
class BackToEncodeArgs(ScriptArgs):
    NAME = "back_to_encode"
    record: str = key()
    encode_stream: str = key()
    start: tuple[State, ...] = arg(table=True)
    generation: int = arg()
    job: str = arg()
    now: str = arg()
    cleared: tuple[str, ...] = arg(table=True)
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class AcquireCreditArgs(ScriptArgs):
    NAME = "acquire_credit"
    credits: str = key()
    record: str = key()
    limit: int = arg()
    now_ms: int = arg()


@dataclass(frozen=True, slots=True)
class ReleaseCreditArgs(ScriptArgs):
    NAME = "release_credit"
    credits: str = key()
    record: str = key()


@dataclass(frozen=True, slots=True)
class SubmitArgs(ScriptArgs):
    NAME = "submit"
    record: str = key()
    active: str = key()
    tenant_active: str = key()
    index: str = key()
    encode_stream: str = key()
    score: int = arg()
    bound: int = arg()
    tenant_bound: int = arg()
    job: str = arg()
    request_id: str = arg()
    now: str = arg()
    fields: RecordWrite = arg(table=True)


@dataclass(frozen=True, slots=True)
class ReadmitArgs(ScriptArgs):
    NAME = "readmit"
    record: str = key()
    active: str = key()
    tenant_active: str = key()
    score: int = arg()
    bound: int = arg()
    tenant_bound: int = arg()


@dataclass(frozen=True, slots=True)
class TrimStreamArgs(ScriptArgs):
    NAME = "trim_stream"
    stream: str = key()
    idle_ms: int = arg()
    kept_since_ms: int = arg()


@dataclass(frozen=True, slots=True)
class ExpireRecordsArgs(ScriptArgs):
    NAME = "expire_records"
    index: str = key()
    records: tuple[str, ...] = key(rest=True)
    cutoff: str = arg()
    ids: tuple[str, ...] = arg(table=True)


@dataclass(frozen=True, slots=True)
class RescueArgs(ScriptArgs):
    NAME = "rescue"
    record: str = key()
    encode_stream: str = key()
    credits: str = key()
    rescued: str = key()
    streams: tuple[str, ...] = key(rest=True)
    seen_state: State = arg()
    seen_updated_at: str = arg()
    generation: int = arg()
    job: str = arg()
    now: str = arg()
    cleared: tuple[str, ...] = arg(table=True)
    counter: str = arg()
    groups: tuple[str, ...] = arg(table=True)
    entry_ids: tuple[str, ...] = arg(table=True)


@dataclass(frozen=True, slots=True)
class WatchArgs(ScriptArgs):
    NAME = "watch"
    record: str = key()
    delta: int = arg()


# Every script, in the library's order (its name carries a digest of them all).
SCRIPT_TYPES: tuple[type[ScriptArgs], ...] = tuple(sorted((
    ClaimArgs, TakeArgs, UpdateArgs, PublishArgs, DeadLetterArgs, CancelArgs, AskPreemptArgs,
    RequeueArgs, RecomputeArgs, BackToEncodeArgs, AcquireCreditArgs, ReleaseCreditArgs,
    SubmitArgs, ReadmitArgs, TrimStreamArgs, ExpireRecordsArgs, RescueArgs, WatchArgs,
), key=lambda cls: cls.NAME))
