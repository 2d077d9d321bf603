"""Request records: one Redis hash per request, the single source of truth for its state.

Every state change goes through a script in ``lua/`` that checks the writer's fencing token (the
delivery attempt it holds), so a worker that was paused past its lease and wakes up can neither
overwrite a newer attempt's progress nor publish a result twice.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.redis_client import RedisClient
from keys import GenerationSpec, Priority
from keys.names import (
    consumer_group,
    dead_letter_stream,
    request_record,
    stage_latency,
    stage_stream,
)
from workers.queue.messages import Job, Stage
from workers.queue.metrics import stages as stage_metrics
from workers.queue.record_write import RecordWrite
from workers.queue.schema import Field, PreemptMode, RequestRecord, State, timestamp
from workers.queue.script_args import (
    CancelArgs,
    ClaimArgs,
    DeadLetterArgs,
    PublishArgs,
    UpdateArgs,
)
from workers.queue.script_library import Result
from workers.queue.script_slots import ScriptArgs
from workers.queue.scripts import Scripts
from workers.queue.spec_json import spec_to_json
from workers.queue.streams import Delivery


@dataclass(frozen=True, slots=True)
class StageResult:
    """What a stage produced for one delivery, ready to publish."""

    job: Job
    delivery: Delivery
    next_job: Job | None
    state: State | None  # None: the stage's finished state
    seconds: float
    fields: RecordWrite
    next_stream: str | None = None  # a worker's inbox, routed there; None: the shared stream


@dataclass(frozen=True, slots=True)
class Progress:
    """What a progress write learns: the request's state (None if the writer is stale) and
    whether someone asked for it to be preempted."""

    state: State | None
    preempt: PreemptMode | None


def initial_fields(spec: GenerationSpec) -> RecordWrite:
    """The record of a request just accepted."""
    now = timestamp()
    return RecordWrite({Field.SPEC: spec_to_json(spec), Field.STATE: State.QUEUED.value,
                        Field.STEP: 0, Field.STEPS: spec.num_inference_steps,
                        Field.CREATED_AT: now, Field.UPDATED_AT: now})


class Records:
    """Reads and fenced writes of request records."""

    def __init__(self, client: RedisClient) -> None:
        self.redis = client
        self.scripts = Scripts(client)

    def get(self, tenant: str, request_id: str) -> RequestRecord | None:
        raw = self.redis.hgetall(request_record(tenant, request_id))
        if not raw:
            return None
        return RequestRecord.parse({k.decode(): v.decode()  # type: ignore[union-attr]
                                    for k, v in raw.items()})

    def states(self, requests: Sequence[tuple[str, str]]) -> list[State | None]:
        """The state of each (tenant, request id), None where it has no record; one round
        trip, none of the records read whole (a client following many requests asks this)."""
        return [None if raw is None else State(raw)
                for raw in self.field_of(requests, Field.STATE)]

    def ended(self, tenant: str, request_ids: Sequence[str]) -> set[str]:
        """Those of ``tenant``'s ``request_ids`` that have ended: done, failed, cancelled or
        no longer recorded. A parked request has not. One that ended may still be resumed or
        recomputed, from encode on."""
        states = self.states([(tenant, r) for r in request_ids])
        return {r for r, s in zip(request_ids, states, strict=True) if s is None or s.terminal}

    def field_of(self, requests: Sequence[tuple[str, str]], name: str) -> list[str | None]:
        """One field of each (tenant, request id)'s record, None where it has none; one
        round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for tenant, request_id in requests:
            pipe.hget(request_record(tenant, request_id), name)
        return [None if raw is None else raw.decode() for raw in pipe.execute()]

    def claim_many(self, claims: Sequence[tuple[Delivery, Job, RecordWrite]]) -> list[Result]:
        """Fence several jobs in one round trip: each job's claim is checked on its own."""
        return self.scripts.results([
            ClaimArgs(request_record(job.tenant, job.request_id), job.stage.value,
                      job.fence_token(d.attempt), job.generation, State.running(job.stage),
                      timestamp(), fields) for d, job, fields in claims])

    def update(self, job: Job, attempt: int, fields: RecordWrite) -> Progress:
        """Write progress if ``attempt`` still owns the request."""
        return _progress(self.scripts.run(_update_args(job, attempt, fields)))

    def update_many(self, writes: Sequence[tuple[Job, int, RecordWrite]]) -> list[Progress]:
        """``update`` for several jobs in one round trip, each fenced on its own."""
        return [_progress(answer) for answer in
                self.scripts.answers([_update_args(*write) for write in writes])]

    def publish_many(self, results: Sequence[StageResult]) -> list[Result]:
        """Atomically per job: hand on the next job, record the state and latency, ack.
        All of them travel in one round trip."""
        return self.publish_then(results, None)[0]

    def publish_then(self, results: Sequence[StageResult],
                     then: ScriptArgs | None) -> tuple[list[Result], Any]:
        """``publish_many``, then the call ``then`` in the same round trip; its answer."""
        now = timestamp()
        answers, following = self.scripts.answers_then(
            [self._publish_args(r, now) for r in results], then)
        return [Result(int(code)) for code in answers], following

    @staticmethod
    def _publish_args(r: StageResult, now: str) -> PublishArgs:
        job = r.job
        record = request_record(job.tenant, job.request_id)
        route = _route(job.stage, job.priority)
        return PublishArgs(
            record, r.delivery.stream, r.next_stream or route.next_stream or record,
            route.latency, job.stage.value, job.fence_token(r.delivery.attempt), route.group,
            r.delivery.entry_id, r.next_job.to_json() if r.next_job else "",
            r.state or route.finished, now, stage_metrics.bucket_field(r.seconds),
            f"{r.seconds:.6f}", r.fields)

    def dead_letter(self, job: Job, delivery: Delivery, reason: str) -> None:
        self._dead_letter(request_record(job.tenant, job.request_id), delivery, job.stage,
                          job.to_json(), reason, job.generation)

    def dead_letter_unreadable(self, delivery: Delivery, stage: Stage) -> None:
        """``dead_letter`` for an entry whose job could be claimed (``lua/take.lua`` read its
        tenant, request id and generation) but not read as a ``Job``."""
        fields = json.loads(delivery.raw)
        self._dead_letter(request_record(str(fields["tenant"]), str(fields["request_id"])),
                          delivery, stage, delivery.raw.decode(errors="replace"),
                          f"{stage} cannot read its job (message version {fields.get('v')})",
                          int(fields.get("generation") or 0))

    def _dead_letter(self, record: str, delivery: Delivery, stage: Stage, job: str,
                     reason: str, generation: int) -> None:
        self.scripts.run(DeadLetterArgs(
            record, delivery.stream, dead_letter_stream(), consumer_group(stage.value),
            delivery.entry_id, job, reason, timestamp(), generation))

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Ask workers to stop at the next step boundary; False if already finished.

        One script, so a request that finishes at the same moment is never marked CANCELLED
        after DONE."""
        return self.scripts.result(CancelArgs(request_record(tenant, request_id),
                                              timestamp())) is Result.OK


@dataclass(frozen=True, slots=True)
class _Route:
    """Where a stage's result goes, for one stage and class."""

    next_stream: str | None  # None: the last stage
    latency: str
    group: str
    finished: State


@functools.cache  # six of them, looked up on every publish
def _route(stage: Stage, priority: Priority) -> _Route:
    following = stage.next
    return _Route(stage_stream(following.value, priority.value) if following else None,
                  stage_latency(stage.value, priority.value), consumer_group(stage.value),
                  State.finished(stage))


def _update_args(job: Job, attempt: int, fields: RecordWrite) -> UpdateArgs:
    return UpdateArgs(request_record(job.tenant, job.request_id), job.stage.value,
                      job.fence_token(attempt), timestamp(), fields)


def _progress(answer: Sequence[bytes | str | int]) -> Progress:
    code, state, preempt = (v.decode() if isinstance(v, bytes) else v for v in answer)
    if Result(int(code)) is Result.STALE:
        return Progress(None, None)
    return Progress(State(str(state)), PreemptMode(str(preempt)) if preempt else None)
