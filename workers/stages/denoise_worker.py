"""The denoise worker's loop around its engine (the loop does the I/O; the engine's scheduler
decides and its executor computes): between two steps, runs that finished or must stop leave
(the finished ones published in one round trip), new jobs join while there is room and their
adapters fit beside the engine's, and waiting runs take their decode credits; then the engine
takes one step for all, the exact CFG tier asked for every run's rows in one round trip first.

Runs of every adapter set share the engine: each row applies its own run's adapters. A job
whose adapters would take the engine past ``workers.lora_slots`` waits, claimed and leased,
until runs leave.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable

import redis
import torch

from cachesvc.errors import StoreFullError, StoreUnavailableError
from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from config.settings import WorkerSettings
from workers.engine.core import StepResult
from workers.engine.run import DenoiseRun
from workers.engine.timing import release_memory
from workers.queue.messages import Job
from workers.queue.metrics.engine import EngineMetrics
from workers.queue.record_write import RecordWrite
from workers.queue.runtime import (
    OUTAGE_FIRST_RETRY_S,
    OUTAGE_MAX_RETRY_S,
    JobContext,
    Outcome,
    PreemptCheck,
    StageWorker,
    TooLargeError,
)
from workers.queue.schema import Field
from workers.queue.streams import Delivery
from workers.stages.denoise import DenoiseHandler

log = logging.getLogger(__name__)

CREDIT_POLL_S = 0.05  # how long a worker whose every run waits for a decode credit sleeps
POLL_S = 0.2  # how often a run that reports nothing asks whether it was cancelled or preempted


class EngineWorker(StageWorker):
    """The denoise worker: its jobs are runs of one engine."""

    handler: DenoiseHandler

    def __init__(self, handler: DenoiseHandler, client: RedisClient, settings: WorkerSettings,
                 preemption: Callable[[Job], PreemptCheck | None] | None = None,
                 inbox: bool = False) -> None:
        super().__init__(handler, client, settings, preemption=preemption, inbox=inbox)
        self.engine = handler.engine
        self.metrics = EngineMetrics(client, self.queue.consumer, self.engine.max_batch)
        self.waiting: list[DenoiseRun] = []  # claimed, not yet in the engine
        self._outage_since: float | None = None  # when the store went away mid-step
        self._outage_delay = OUTAGE_FIRST_RETRY_S

    def _loop(self, idle_ms: int) -> None:
        try:
            self._turns(idle_ms)
        finally:
            with contextlib.suppress(redis.RedisError):  # the entry only goes stale
                self.metrics.close()

    def _turns(self, idle_ms: int) -> None:
        recovering = False
        while not (self.stop.is_set() and not self._held()):
            try:
                self._leave()
                if not self.stop.is_set():
                    recovering = self._join(idle_ms, recovering)
                self._take_in()
                self._take_credits()
                self._step()
                self._report()
            except REDIS_ERRORS as exc:
                log.warning("Redis error in the denoise loop (%s); retrying", exc)
                recovering = True
                self.stop.wait(1.0)
                with contextlib.suppress(redis.RedisError):  # logged above; retried next turn
                    self.queue.ensure_group()

    def _held(self) -> list[DenoiseRun]:
        return [*self.engine.runs, *self.waiting]

    def _room(self) -> int:
        """Jobs this worker may still take: the engine's room less the runs waiting to join."""
        return self.engine.room - len(self.waiting)

    # --- between steps ---------------------------------------------------------------------

    def _join(self, idle_ms: int, recovering: bool) -> bool:
        """Read new jobs while there is room; block only when the engine holds nothing. A
        full engine still takes interactive work, in a batch run's place (``_make_way``)."""
        room = self._room()
        if room <= 0:
            if not recovering:
                self._make_way()
            return recovering
        if recovering:
            # What this worker held when Redis went away is still pending under its name.
            in_hand = frozenset((r.delivery.stream, r.delivery.entry_id) for r in self._held())
            deliveries = self.queue.own_pending(room, in_hand)
            recovering = bool(deliveries)
        else:
            block = None if self._held() else self.settings.block_ms
            deliveries = self.read(block, idle_ms, room)
        owned = self.claim(deliveries)
        # Leased at once: the later ones of a read wait while the first start.
        self.leases.acquire(*(d for _, d in owned))
        for job, delivery in owned:
            self._start(job, delivery)
        return recovering

    def _make_way(self) -> None:
        """A full engine takes waiting interactive work at this step boundary: the batch run
        the scheduler picks leaves now (re-queued from the checkpoint it writes as it stops)
        and the interactive run joins, so its first step is the engine's next one. A worker
        blocked on an empty queue would have read the entry as it arrived, so one still
        waiting here has no idle worker to go to (``workers.preempt_grace_ms`` leaves it
        longer to one that will have room). Runs that may not be preempted (past
        ``max_preemptions``, or preemption off) leave nothing to make way with; nor does an
        engine with runs of its own still waiting to join."""
        if self.waiting:
            return
        chosen = self.engine.scheduler.make_way([r.view for r in self.engine.runs])
        if chosen is None:
            return
        victim = self.engine.runs[chosen]
        if not victim.ctx.may_make_way():
            return
        owned = self.claim(self.queue.take_interactive(1, self._first_claim))
        if not owned:
            return
        victim.ctx.make_way()
        self._leave()
        self.leases.acquire(*(d for _, d in owned))
        for job, delivery in owned:
            self._start(job, delivery)

    def _start(self, job: Job, delivery: Delivery) -> None:
        ctx = self.context(job, delivery)
        begun = time.monotonic()
        try:
            run = self.through_outages(ctx, lambda: self.handler.start(ctx, delivery))
        except Exception as exc:
            self.leases.release(delivery)
            self.failed(ctx, delivery, exc)
            return
        run.joined_at = begun  # the stage's seconds count the start too
        self.waiting.append(run)

    def context(self, job: Job, delivery: Delivery) -> JobContext:
        """A deferred context: the loop writes every run's progress in one round trip."""
        check = self._preemption(job) if self._preemption is not None else None
        return JobContext(self.records, job, delivery.attempt, check, self.stop, deferred=True)

    def _report(self) -> None:
        """Every run's progress since the last turn, in one round trip; a run that reported
        nothing is asked about every ``POLL_S`` all the same, so it learns of a cancel or a
        preemption while it waits."""
        now = time.monotonic()
        writes = [(run, fields) for run in self._held()
                  if (fields := run.ctx.take()).set or fields.add
                  or now - run.ctx.heard_at >= POLL_S]
        if writes:
            try:
                answers = self.records.update_many(
                    [(run.ctx.job, run.ctx.attempt, fields) for run, fields in writes])
            except redis.RedisError:
                for run, fields in writes:
                    run.ctx.give_back(fields)
                raise
            for (run, _), progress in zip(writes, answers, strict=True):
                run.ctx.learn(progress)

    def _take_in(self) -> None:
        """Waiting runs join as the scheduler admits them (room, and adapters that fit beside
        the engine's), their adapters loaded first."""
        if not self.waiting:
            return
        admitted = self.engine.scheduler.admit([r.view for r in self.engine.runs],
                                               [r.view for r in self.waiting])
        for run in [self.waiting[n] for n in admitted]:
            self.waiting.remove(run)
            in_use = {lora.hash for held in self.engine.runs for lora in held.spec.loras}
            try:
                self.through_outages(run.ctx, functools.partial(self.handler.load_adapters,
                                                                run, in_use))
            except Exception as exc:  # its adapters cannot be loaded: it cannot move
                self._drop(run, exc)
                continue
            self.engine.add(run)

    def _take_credits(self) -> None:
        for run in self.engine.runs:
            if not run.has_credit and not run.wants_stop:
                self.handler.take_credit(run)

    def _step(self) -> None:
        if not any(r.has_credit for r in self.engine.runs):
            if self.engine.runs:  # every run waits for a decode credit
                self.stop.wait(CREDIT_POLL_S)
            return
        fresh = [r for r in self.engine.runs if r.first_step_at is None]
        failure: Exception | None = None
        try:
            planned = self.engine.plan()
            self.handler.exact_tier.look_up([(run.guidance, plan) for run, plan in planned])
            result = self.engine.run(planned)
            self.handler.exact_tier.store(result.done)
        except (StoreUnavailableError, StoreFullError) as away:
            self._outage(away)  # nothing of the step was applied: it is taken again
            return
        except Exception as exc:
            log.warning("a batched step failed; each run steps alone to find which",
                        exc_info=True)
            failure = exc
        if failure is not None:
            # Retried out here, not in the except block: its traceback holds the frames of
            # the failed forward, and with them its activations, which the retries need.
            out_of_memory = isinstance(failure, torch.OutOfMemoryError)
            del failure
            if out_of_memory:
                self.engine.fit_after_out_of_memory()
            result = self._step_alone()
        self._outage_since = None
        for run, error in result.failed:
            self.engine.abort(run)
            self._drop(run, error)
        self.handler.after_step(result.advanced)
        now = time.time()
        self.metrics.step(result.forwards,
                          [now - r.queued_at for r in fresh if r.first_step_at is not None],
                          len(self.engine.runs))

    def _step_alone(self) -> StepResult:
        """Each run's step on its own, after a batched one raised: only a run whose own step
        raises leaves (unacknowledged, redelivered from its checkpoint; or failed at once
        when even its own rows do not fit in the device's memory)."""
        merged = StepResult()
        for run in list(self.engine.runs):
            try:
                planned = self.engine.plan([run])
                self.handler.exact_tier.look_up([(run.guidance, plan) for _, plan in planned])
                alone = self.engine.run(planned)
                self.handler.exact_tier.store(alone.done)
            except torch.OutOfMemoryError:
                merged.failed.append((run, TooLargeError(run.ctx.job, self.engine.describe(run))))
                release_memory(self.engine.model.device)
                continue
            except Exception as exc:
                log.warning("request %s: its step failed alone", run.ctx.job.request_id,
                            exc_info=True)
                merged.failed.append((run, exc.with_traceback(None)))  # frames: see ``_step``
                continue
            merged.forwards.extend(alone.forwards)
            merged.advanced.extend(alone.advanced)
            merged.done.extend(alone.done)
            merged.failed.extend(alone.failed)
        return merged

    def _outage(self, exc: Exception) -> None:
        """The store is away mid-step: wait with back-off and take the step again, until
        ``outage_budget_s`` has passed; then the runs leave unacknowledged."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since, self._outage_delay = now, OUTAGE_FIRST_RETRY_S
        if now - self._outage_since + self._outage_delay > self.settings.outage_budget_s:
            self._outage_since = None
            for run in list(self.engine.runs):
                self.engine.abort(run)
                self._drop(run, exc)
            return
        log.warning("store unavailable mid-step (%s); retrying in %.1f s", exc,
                    self._outage_delay)
        for run in self.engine.runs:
            run.ctx.progress(RecordWrite({Field.WAITING: f"store: {exc}"}))
        self.stop.wait(self._outage_delay)
        self._outage_delay = min(self._outage_delay * 2, OUTAGE_MAX_RETRY_S)

    def _leave(self) -> None:
        """Runs that finished or must stop leave: published or re-queued together."""
        leaving = self.engine.leaving()
        stopped = [r for r in self.waiting if r.wants_stop]
        self.waiting = [r for r in self.waiting if r not in stopped]
        results, left = [], []
        for run in [*leaving, *stopped]:
            try:
                outcome = self.through_outages(run.ctx, functools.partial(self._outcome, run))
            except Exception as exc:
                self._drop(run, exc)
                continue
            seconds = time.monotonic() - run.joined_at
            results.append(self.result(run.ctx, run.delivery, outcome, seconds))
            left.append(run.delivery)
        try:
            self.settle(results)
        finally:
            self.leases.release(*left)

    def _outcome(self, run: DenoiseRun) -> Outcome:
        return self.handler.finish(run) if run.finished else self.handler.stopped(run)

    def _drop(self, run: DenoiseRun, exc: Exception) -> None:
        self.leases.release(run.delivery)
        self.failed(run.ctx, run.delivery, exc)
