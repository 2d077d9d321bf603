"""Preemption and resume: the transitions that take a request off a worker and put it back.

A preempted job writes a checkpoint and is re-queued under a new generation (or parked), which
is not a failed delivery; ``resume`` puts a preempted, cancelled or failed request back at the
encode stage, from where denoise continues at its latest checkpoint.
"""

from __future__ import annotations

import dataclasses

from cachesvc.redis_client import RedisClient
from keys import KeyKind
from keys.names import consumer_group, decode_credits, request_record, stage_stream
from workers.queue.messages import Job, Stage
from workers.queue.record_write import NOTHING, RecordWrite
from workers.queue.schema import (
    RESUMABLE,
    Field,
    KindField,
    PreemptMode,
    RequestRecord,
    StageField,
    State,
    timestamp,
)
from workers.queue.script_args import AskPreemptArgs, BackToEncodeArgs, RecomputeArgs, RequeueArgs
from workers.queue.script_library import Result
from workers.queue.scripts import Scripts
from workers.queue.streams import Delivery
from workers.queue.submit import run_durably


class LifecycleError(RuntimeError):
    """The request cannot be preempted or resumed as asked; names the request and why."""


def redone_fields(start: Stage) -> tuple[str, ...]:
    """Fields that a request sent back to ``start`` clears: its next generation redoes them."""
    stages = list(Stage)
    return tuple(StageField.DONE.of(s) for s in stages[stages.index(start):])


class Lifecycle:
    """The fenced scripts that take a request off a worker and put it back."""

    def __init__(self, client: RedisClient) -> None:
        self.redis = client
        self.scripts = Scripts(client)

    def ask_preempt(self, tenant: str, request_id: str, mode: PreemptMode) -> bool:
        """Ask the worker denoising the request to stop at its next step boundary; False if
        the request is not denoising."""
        result = self.scripts.result(AskPreemptArgs(request_record(tenant, request_id),
                                                    mode.value, timestamp()))
        if result is Result.MISSING:
            raise LifecycleError(f"request {request_id} does not exist")
        return result is Result.OK

    def requeue(self, job: Job, delivery: Delivery, mode: PreemptMode,
                fields: RecordWrite) -> Result:
        """Hand a preempted job back: a new entry (or none, to park), the old one acked, its
        decode credit released, all in one script fenced by the delivery's token.
        OK, STALE (nothing written) or FINISHED (cancelled meanwhile: acknowledged only)."""
        following = dataclasses.replace(job, generation=job.generation + 1)
        return self.scripts.result(RequeueArgs(
            request_record(job.tenant, job.request_id), delivery.stream,
            stage_stream(job.stage.value, job.priority.value), decode_credits(),
            job.stage.value, job.fence_token(delivery.attempt), consumer_group(job.stage.value),
            delivery.entry_id, following.to_json() if mode is PreemptMode.REQUEUE else "",
            following.generation, State.waiting_for(job.stage), timestamp(), fields))

    def resume(self, record: RequestRecord) -> None:
        """Put a preempted, cancelled or failed request back in the encode stream, durably."""
        spec = record.spec
        if not record.state.resumable:
            raise LifecycleError(f"request {spec.request_id} is {record.state.value}; only "
                                 f"{', '.join(sorted(s.value for s in RESUMABLE))} requests "
                                 "can be resumed")
        cleared = (*redone_fields(Stage.ENCODE), Field.ERROR, Field.OUTPUT_KEY, Field.PREEMPT)
        result = self._back_to_encode(record, RESUMABLE, cleared,
                                      RecordWrite(add={Field.RESUMES: 1}))
        if result is not Result.OK:
            raise LifecycleError(f"request {spec.request_id} changed while resuming it; "
                                 "read its state and try again")

    def recompute(self, job: Job, delivery: Delivery, redo: Job, lost: KeyKind,
                  max_recomputes: int) -> Result:
        """Send the request back to ``redo.stage``, which produces the lost input, under the
        next generation: neither a failed delivery nor a preemption. Past ``max_recomputes``
        the request fails (OVER_BOUND), naming the kind the store kept losing."""
        following = dataclasses.replace(redo, generation=job.generation + 1)
        return self.scripts.result(RecomputeArgs(
            request_record(job.tenant, job.request_id), delivery.stream,
            stage_stream(redo.stage.value, job.priority.value), decode_credits(),
            job.stage.value, job.fence_token(delivery.attempt), consumer_group(job.stage.value),
            delivery.entry_id, following.to_json(), following.generation,
            State.waiting_for(redo.stage), timestamp(), lost.value, max_recomputes,
            f"the store lost this request's {lost.value} entries more than {max_recomputes} "
            "times (workers.max_recomputes)", redone_fields(redo.stage)))

    def recompute_output(self, record: RequestRecord) -> bool:
        """Run a DONE request whose output was lost through the pipeline again (it is seeded,
        so the output is the same); False if it changed meanwhile."""
        result = self._back_to_encode(
            record, frozenset({State.DONE}), (*redone_fields(Stage.ENCODE), Field.OUTPUT_KEY),
            RecordWrite(add={KindField.RECOMPUTED.of(KeyKind.OUTPUT): 1}))
        return result is Result.OK

    def _back_to_encode(self, record: RequestRecord, start: frozenset[State],
                        cleared: tuple[str, ...], fields: RecordWrite = NOTHING) -> Result:
        """Put the request at encode under its next generation, durably."""
        spec = record.spec
        job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority,
                  generation=record.generation + 1)
        (code,) = run_durably(self.redis, spec.request_id, lambda pipe: self.scripts.run(
            BackToEncodeArgs(request_record(spec.tenant, spec.request_id),
                             stage_stream(Stage.ENCODE.value, spec.priority.value),
                             tuple(sorted(start)), job.generation, job.to_json(), timestamp(),
                             cleared, fields), pipe))
        return Result(int(code))
