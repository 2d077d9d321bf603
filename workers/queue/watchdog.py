"""The watchdog: checks that every request still in flight has a live owner or a queue entry
that someone will deliver, and re-queues one that has neither from its last checkpoint.

Takeover (``StageQueue._take_over``) is what recovers the work of a dead worker; the watchdog
is the proof that it did. A rescue means a job could wait where no takeover looked: it is
counted (``diffcache_requests_rescued_total``), logged with the request's id and shown on the
dashboard, and in normal operation it never happens.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis

from cachesvc.redis_client import RedisClient
from keys.names import (
    active_requests,
    consumer_group,
    decode_credits,
    request_record,
    rescued_requests,
    stage_stream,
)
from workers.queue.heartbeats import live_workers
from workers.queue.lifecycle import redone_fields
from workers.queue.messages import Job, Stage
from workers.queue.schema import IDLE, Field, RequestRecord, StageField, State, timestamp
from workers.queue.script_args import RescueArgs
from workers.queue.script_library import Result
from workers.queue.scripts import Scripts
from workers.queue.streams import stage_streams

log = logging.getLogger(__name__)

# Entries read per stream and pass: a stage whose backlog is deeper than this is not judged,
# since a request beyond the page might be waiting in it.
_PAGE = 10_000


class RescueReason(StrEnum):
    DEAD_CONSUMER = "dead_consumer"  # its only entries are pending under workers that are gone
    NO_ENTRY = "no_entry"  # no stream holds an entry for it at all


@dataclass(frozen=True, slots=True)
class Rescue:
    tenant: str
    request_id: str
    stage: Stage
    reason: RescueReason


@dataclass(frozen=True, slots=True)
class PatrolReport:
    """What one pass examined and whom it re-queued."""

    examined: int
    rescued: tuple[Rescue, ...]


@dataclass(frozen=True, slots=True)
class _Entry:
    stream: str
    entry_id: str
    stage: Stage


@dataclass(slots=True)
class _Sightings:
    """Where the pass saw each request's entries: keyed by (tenant, request id)."""

    covered: set[tuple[str, str]] = field(default_factory=set)
    dead: defaultdict[tuple[str, str], list[_Entry]] = field(
        default_factory=lambda: defaultdict(list))
    unjudged: set[Stage] = field(default_factory=set)  # backlog deeper than one page
    live: dict[Stage, set[str]] = field(default_factory=dict)


def stage_of(state: State) -> Stage:
    """The stage that runs, or will run, a request in ``state`` next."""
    for stage in Stage:
        if state in (State.running(stage), State.waiting_for(stage)):
            return stage
    raise ValueError(f"a {state.value} request waits for no stage")


class Watchdog:
    """``patrol`` examines every queued or running request once; the sweeper calls it."""

    def __init__(self, client: RedisClient, orphan_after_s: float, live_within_s: float) -> None:
        self.redis = client
        self.orphan_after_s = orphan_after_s
        self.live_within_s = live_within_s
        self.scripts = Scripts(client)

    def patrol(self) -> PatrolReport:
        # Streams first, records second: a request that moves in between has a fresh
        # ``updated_at`` by the time its record is read, and a fresh request is never judged.
        seen = self._sightings()
        members: list[bytes] = self.redis.zrange(active_requests(), 0, -1)  # type: ignore[assignment]
        rescued: list[Rescue] = []
        for record_key in (m.decode() for m in members):
            rescue = self._judge(record_key, seen)
            if rescue is not None:
                rescued.append(rescue)
        return PatrolReport(len(members), tuple(rescued))

    def _sightings(self) -> _Sightings:
        seen = _Sightings()
        bound_ms = self.orphan_after_s * 1000
        for stage in Stage:
            live = seen.live[stage] = live_workers(self.redis, stage, self.live_within_s)
            group = consumer_group(stage.value)
            for stream in stage_streams(self.redis, stage):
                pending, unread, complete = self._entries(stream, group)
                if not complete:
                    seen.unjudged.add(stage)
                for job in unread:
                    seen.covered.add((job.tenant, job.request_id))
                for p, job in pending:
                    who = (job.tenant, job.request_id)
                    if p["consumer"].decode() in live or p["time_since_delivered"] < bound_ms:
                        seen.covered.add(who)  # held, or takeover still has time for it
                    else:
                        seen.dead[who].append(_Entry(stream, p["message_id"].decode(), stage))
        return seen

    def _entries(self, stream: str, group: str) -> tuple[list[tuple[dict[str, Any], Job]],
                                                         list[Job], bool]:
        """The stream's pending entries (with their XPENDING details) and unread entries, as
        jobs; and whether both fit in one page."""
        try:
            groups: list[dict[str, Any]] = self.redis.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream: nothing waits in it
            return [], [], True
        ours = next((g for g in groups if g["name"].decode() == group), None)
        if ours is None:
            return [], [], True
        details: list[dict[str, Any]] = self.redis.xpending_range(
            stream, group, min="-", max="+", count=_PAGE)
        pipe = self.redis.pipeline(transaction=False)
        for p in details:
            pipe.xrange(stream, p["message_id"], p["message_id"])
        last = ours["last-delivered-id"].decode()
        pipe.xrange(stream, min=f"({last}", count=_PAGE)
        *bodies, after = pipe.execute()
        pending = [(p, job) for p, body in zip(details, bodies, strict=True)
                   if body and (job := _job(body[0])) is not None]
        unread = [job for entry in after if (job := _job(entry)) is not None]
        return pending, unread, len(details) < _PAGE and len(after) < _PAGE

    def _judge(self, record_key: str, seen: _Sightings) -> Rescue | None:
        raw: dict[bytes, bytes] = self.redis.hgetall(record_key)  # type: ignore[assignment]
        if not raw:
            return None
        try:
            record = RequestRecord.parse({k.decode(): v.decode() for k, v in raw.items()})
        except (KeyError, ValueError):  # not a record any worker could run either
            log.error("watchdog: %s is not a readable request record; left alone", record_key,
                      exc_info=True)
            return None
        spec = record.spec
        who = (spec.tenant, spec.request_id)
        if record.state in IDLE or who in seen.covered:
            return None
        stage = stage_of(record.state)
        if stage in seen.unjudged or time.time() - record.updated_at < self.orphan_after_s:
            return None
        owner = record.get(StageField.WORKER.of(stage))
        if record.state is State.running(stage) and owner in seen.live[stage]:
            return None
        dead = seen.dead.get(who, [])
        if dead and not seen.live[stage]:
            # No worker of the stage lives to have taken it over: capacity, not a lost job.
            return None
        reason = RescueReason.DEAD_CONSUMER if dead else RescueReason.NO_ENTRY
        if not self._rescue(record, stage, reason, dead):
            return None
        log.error("watchdog: request %s of tenant %s had no live owner at %s (%s); re-queued "
                  "from its last checkpoint", spec.request_id, spec.tenant, stage.value,
                  reason.value)
        return Rescue(spec.tenant, spec.request_id, stage, reason)

    def _rescue(self, record: RequestRecord, stage: Stage, reason: RescueReason,
                dead: Sequence[_Entry]) -> bool:
        spec = record.spec
        job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority,
                  generation=record.generation + 1)
        result = self.scripts.result(RescueArgs(
            request_record(spec.tenant, spec.request_id),
            stage_stream(Stage.ENCODE.value, spec.priority.value), decode_credits(),
            rescued_requests(), tuple(e.stream for e in dead), record.state,
            record.fields[Field.UPDATED_AT], job.generation, job.to_json(), timestamp(),
            redone_fields(Stage.ENCODE), f"{stage.value}:{reason.value}",
            tuple(consumer_group(e.stage.value) for e in dead),
            tuple(e.entry_id for e in dead)))
        return result is Result.OK


def read_rescued(client: RedisClient) -> dict[tuple[Stage, RescueReason], int]:
    """(stage, reason) -> requests the watchdog re-queued, since the cluster started."""
    raw: dict[bytes, bytes] = client.hgetall(rescued_requests())  # type: ignore[assignment]
    out: dict[tuple[Stage, RescueReason], int] = {}
    for name, count in raw.items():
        stage, _, reason = name.decode().partition(":")
        out[Stage(stage), RescueReason(reason)] = int(count)
    return out


def _job(entry: Any) -> Job | None:
    _, fields = entry
    try:
        return Job.from_json(fields.get(b"job", b""))
    except ValueError:
        return None  # malformed: the worker that reads it dead-letters it
