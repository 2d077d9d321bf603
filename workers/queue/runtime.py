"""The loop every stage worker runs: take a delivery, fence it, run the stage, publish once.

A stage handler computes; this module owns delivery, leases, retries, dead letters and the
request record, so the three stages share one implementation of the queue contract.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import redis

from cachesvc.errors import StoreFullError, StoreUnavailableError
from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from config.settings import WorkerSettings
from keys import GenerationSpec, KeyKind
from workers.queue.affinity import AdapterRouter
from workers.queue.heartbeats import Heartbeat
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Job, Stage
from workers.queue.record_write import NOTHING, RecordWrite
from workers.queue.records import Progress, Records, StageResult
from workers.queue.schema import Field, PreemptMode, StageField, State
from workers.queue.script_library import Result
from workers.queue.streams import Delivery, LeaseKeeper, StageQueue

log = logging.getLogger(__name__)
T = TypeVar("T")

OUTAGE_FIRST_RETRY_S = 0.5
OUTAGE_MAX_RETRY_S = 8.0


class StageError(RuntimeError):
    """A stage could not process a job; names the request and stage."""

    def __init__(self, job: Job, message: str) -> None:
        super().__init__(f"{job.stage} of request {job.request_id}: {message}")
        self.job = job


class InputLostError(StageError):
    """A stage's input is not in the store (evicted, expired, or lost with a storage node).
    The store is a cache: this is not a failure but a recompute, by the job ``redo`` of the
    stage that produces the input."""

    def __init__(self, job: Job, kind: KeyKind, redo: Job, keys: Sequence[str]) -> None:
        super().__init__(job, f"{kind.value} input missing from the store ({', '.join(keys)}); "
                         f"recomputing it at {redo.stage.value}")
        self.kind = kind
        self.redo = redo


class TooLargeError(StageError):
    """A job that cannot run on this worker's device however it is batched (its own rows do
    not fit in memory): it fails at once with the reason, since every delivery would fail
    alike."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a handler hands back: the next stage's job and what to write to the record."""

    next_job: Job | None
    state: State | None = None  # default: the stage's finished state
    fields: RecordWrite = NOTHING
    # Set when the job stopped early to be re-queued or parked, not finished.
    preempted: PreemptMode | None = None
    # Adapter hashes the next job needs: a router may send it to a worker that holds them.
    affinity: tuple[str, ...] = ()


# Asked by the denoise engine, at a step boundary, whether a batch job in hand should make way
# for waiting interactive work (``workers.queue.preemption``).
PreemptCheck = Callable[[], PreemptMode | None]


class JobContext:
    """What a handler may do besides computing: report progress and notice cancellation or a
    request to preempt.

    Progress is written by a background thread, so a compute loop that reports every step
    never waits on Redis; what each write answers tells it of a cancellation, a newer attempt
    or a preemption asked through the API. A context
    made ``deferred`` has no thread: its owner takes what it gathered (``take``) and writes
    it with others in one round trip, then hands back what the write learnt (``learn``).
    """

    def __init__(self, records: Records, job: Job, attempt: int,
                 preempt_check: PreemptCheck | None = None,
                 stopping: threading.Event | None = None, deferred: bool = False) -> None:
        self.job = job
        self.attempt = attempt
        self._records = records
        self._preempt_check = preempt_check
        self._asked: PreemptMode | None = None
        self._stopping = stopping
        self._pending = NOTHING
        self._lock = threading.Lock()
        # Set by the progress thread, read by the handler: plain flags (a bool is written
        # whole), not Events, since every delivery makes a context and most report nothing.
        self.cancelled = False
        self.stale = False  # a newer attempt owns the request
        self.heard_at = time.monotonic()  # when a write last told us the request's state
        # Made by the first progress report: a stage that reports nothing costs nothing.
        self._deferred = deferred
        self._wake: threading.Event | None = None
        self._done = False
        self._thread: threading.Thread | None = None

    @property
    def preempt(self) -> PreemptMode | None:
        """Whether the job should step aside at its next step boundary, and how. A worker
        shutting down re-queues its job, so nothing in hand waits for it to come back."""
        if self._asked is None and self._stopping is not None and self._stopping.is_set():
            return PreemptMode.REQUEUE
        return self._asked

    @property
    def preemptible(self) -> bool:
        """Whether this job may yet be asked to make way for waiting interactive work."""
        return self._asked is None and self._preempt_check is not None

    def spec(self) -> GenerationSpec:
        """The request this job belongs to, from its record."""
        record = self._records.get(self.job.tenant, self.job.request_id)
        if record is None:
            raise StageError(self.job, "request record is missing")
        return record.spec

    def progress(self, fields: RecordWrite) -> None:
        with self._lock:
            self._pending |= fields
            if self._deferred:
                return
            if self._wake is None:
                self._wake = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._wake,),
                                                name="progress", daemon=True)
                self._thread.start()
            wake = self._wake
        wake.set()

    def take(self) -> RecordWrite:
        """What was reported since the last write (deferred contexts)."""
        with self._lock:
            fields, self._pending = self._pending, NOTHING
        return fields

    def give_back(self, fields: RecordWrite) -> None:
        """``fields`` were not written after all: they go out with the next write."""
        with self._lock:
            self._pending = fields | self._pending

    def may_make_way(self) -> bool:
        """Whether the preemption check says interactive work waits for this job's place."""
        return self.preemptible and self._preempt_check is not None and (
            self._preempt_check() is not None)

    def make_way(self) -> None:
        """Step aside now (re-queued at the next boundary): this worker took interactive work
        in the job's place."""
        if self.preemptible:
            self._asked = PreemptMode.REQUEUE

    def learn(self, progress: Progress) -> None:
        """What a write of this job's progress answered."""
        self.heard_at = time.monotonic()
        if progress.state is None:
            self.stale = True
        elif progress.state is State.CANCELLED:
            self.cancelled = True
        if progress.preempt is not None:
            self._asked = progress.preempt

    def _flush(self) -> None:
        fields = self.take()
        try:
            progress = self._records.update(self.job, self.attempt, fields)
        except redis.RedisError:
            log.warning("progress of %s not written", self.job.request_id, exc_info=True)
            self.give_back(fields)
            return
        self.learn(progress)

    def _run(self, wake: threading.Event) -> None:
        while not self._done:
            wake.wait(0.2)
            wake.clear()
            self._flush()

    def close(self) -> None:
        self._done = True
        if self._wake is not None:
            self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self._pending.set or self._pending.add:
            self._flush()

    @property
    def should_stop(self) -> bool:
        return self.cancelled or self.stale


class StageHandler(Protocol):
    stage: Stage

    def discard(self, outcome: Outcome) -> None:
        """Undo what a job wrote for a result that was not published (a stale attempt)."""


class Handler(StageHandler, Protocol):
    """A stage that runs one job at a time (encode, decode)."""

    def handle(self, ctx: JobContext) -> Outcome: ...


def consumer_name(pid: int | None = None) -> str:
    """The consumer name of the worker process ``pid`` (default: this one)."""
    return f"{socket.gethostname()}-{os.getpid() if pid is None else pid}"


class StageWorker:
    """The queue contract every stage worker keeps: claim with fencing, leases, retries
    through store outages, dead letters, publish or re-queue. Subclasses say how jobs run."""

    def __init__(self, handler: StageHandler, client: RedisClient, settings: WorkerSettings,
                 after_publish: Callable[[Job, Outcome], None] | None = None,
                 preemption: Callable[[Job], PreemptCheck | None] | None = None,
                 router: AdapterRouter | None = None, inbox: bool = False) -> None:
        self.handler = handler
        self.settings = settings
        self.records = Records(client)
        self.lifecycle = Lifecycle(client)
        self._preemption = preemption
        self.queue = StageQueue(client, handler.stage, consumer_name(),
                                settings.affinity_wait_ms if inbox else None)
        self._router = router
        self.leases = LeaseKeeper(self.queue, settings.idle_timeout_s / 3)
        self._after_publish = after_publish
        self.stop = threading.Event()
        self._first_claim = self.claim_write(1)  # what claiming a new entry writes

    def run(self) -> None:
        self.queue.ensure_group()
        heartbeat = Heartbeat(self.queue.redis, self.handler.stage, self.queue.consumer,
                              self.settings.heartbeat_s)
        log.info("%s worker %s ready", self.handler.stage, self.queue.consumer)
        idle_ms = int(self.settings.idle_timeout_s * 1000)
        try:
            self._loop(idle_ms)
        finally:
            heartbeat.close()
            self.leases.close()

    def claim_write(self, attempt: int) -> RecordWrite:
        """What this worker's claim of a delivery ``attempt`` writes to the record."""
        stage = self.handler.stage
        return RecordWrite({StageField.ATTEMPT.of(stage): attempt,
                            StageField.WORKER.of(stage): self.queue.consumer})

    def read(self, block_ms: int | None, idle_ms: int, count: int) -> list[Delivery]:
        """Up to ``count`` deliveries (``StageQueue.next``); new ones found at once come
        claimed as they are read."""
        return self.queue.next(block_ms, idle_ms, count, self._first_claim)

    def claim(self, deliveries: list[Delivery]) -> list[tuple[Job, Delivery]]:
        """The deliveries this attempt now owns, fenced in one round trip (none, when the
        read claimed them all); the others are dropped, dead-lettered, or acknowledged as
        needing no work."""
        runnable = [(job, d) for d in deliveries if (job := self._admissible(d)) is not None]
        fresh = iter(self.records.claim_many([(d, job, self.claim_write(d.attempt))
                                              for job, d in runnable if d.claim is None]))
        claims = [d.claim if d.claim is not None else next(fresh) for _, d in runnable]
        stage = self.handler.stage
        owned: list[tuple[Job, Delivery]] = []
        for (job, d), claim in zip(runnable, claims, strict=True):
            if claim is Result.OK:
                owned.append((job, d))
            elif claim is Result.STALE:
                log.warning("request %s: attempt %d is stale", job.request_id, d.attempt)
            else:
                log.info("request %s: %s needs no work (%s)", job.request_id, stage, claim.name)
                self.queue.ack(d)
        return owned

    def settle(self, results: list[tuple[StageResult, Outcome]],
               take: int = 0) -> list[Delivery]:
        """Re-queue what stopped early and publish the rest in one round trip; a result that
        lost its fence has what it wrote discarded. With ``take``, the same round trip reads
        up to that many new deliveries, claimed (``StageQueue.take_later``), and answers them;
        none when the queue has none or wants a look for stale entries first."""
        finished = [(r, o) for r, o in results if o.preempted is None]
        for result, outcome in results:
            if outcome.preempted is not None:
                self._requeue(result, outcome)
        then = (self.queue.take_later(take, self._first_claim)
                if take and not self.stop.is_set() else None)
        published, taken = self.records.publish_then([r for r, _ in finished], then)
        for (result, outcome), status in zip(finished, published, strict=True):
            if status is Result.OK:
                if self._after_publish is not None:
                    self._after_publish(result.job, outcome)
                continue
            if status is Result.STALE:
                log.warning("request %s: result of stale attempt %d discarded",
                            result.job.request_id, result.delivery.attempt)
            # A duplicate's outputs are the ones already handed on: only a stale result, or one
            # of a request that finished meanwhile, owns what it wrote.
            if status in (Result.STALE, Result.FINISHED):
                self.handler.discard(outcome)
        return self.queue.taken(taken) if then is not None else []

    def _requeue(self, result: StageResult, outcome: Outcome) -> None:
        assert outcome.preempted is not None
        job = result.job
        status = self.lifecycle.requeue(job, result.delivery, outcome.preempted, result.fields)
        log.info("request %s preempted at %s (%s): %s", job.request_id, job.stage,
                 outcome.preempted.value, status.name)
        if status is Result.STALE:
            self.handler.discard(outcome)

    def through_outages(self, ctx: JobContext, work: Callable[[], T]) -> T:
        """``work``, run again with back-off while the store is unreachable: an outage costs
        time, not deliveries, until ``outage_budget_s`` has passed. Stages are idempotent,
        and denoise continues from its latest checkpoint."""
        deadline = time.monotonic() + self.settings.outage_budget_s
        delay = OUTAGE_FIRST_RETRY_S
        while True:
            try:
                return work()
            except (StoreUnavailableError, StoreFullError) as exc:
                if time.monotonic() + delay > deadline or self.stop.is_set():
                    raise
                log.warning("request %s: %s; retrying %s in %.1f s", ctx.job.request_id, exc,
                            ctx.job.stage, delay)
                ctx.progress(RecordWrite({Field.WAITING: f"store: {exc}"}))
                self.stop.wait(delay)
                delay = min(delay * 2, OUTAGE_MAX_RETRY_S)

    def _recompute(self, job: Job, delivery: Delivery, lost: InputLostError) -> None:
        status = self.lifecycle.recompute(job, delivery, lost.redo, lost.kind,
                                          self.settings.max_recomputes)
        log.warning("request %s: %s (%s)", job.request_id, lost, status.name)

    def _admissible(self, delivery: Delivery) -> Job | None:
        """The delivery's job, or None if it is dropped or dead-lettered instead of run."""
        job = delivery.job
        if job is None:
            if delivery.claim is Result.OK:
                # The read claimed a request whose job this release cannot read: its record
                # now names this live worker as its owner, so nothing would ever rescue it.
                # It fails, with the reason, through the dead letters.
                log.error("dead-lettering unreadable entry %s: %r", delivery.entry_id,
                          delivery.raw[:200])
                self.records.dead_letter_unreadable(delivery, self.handler.stage)
                return None
            log.error("dropping malformed entry %s: %r", delivery.entry_id, delivery.raw[:200])
            self.queue.ack(delivery)
            return None
        if delivery.attempt > self.settings.max_deliveries:
            reason = (f"{job.stage} failed {delivery.attempt - 1} deliveries "
                      f"(max {self.settings.max_deliveries})")
            log.error("dead-lettering request %s: %s", job.request_id, reason)
            self.records.dead_letter(job, delivery, reason)
            return None
        return job

    def context(self, job: Job, delivery: Delivery) -> JobContext:
        check = self._preemption(job) if self._preemption is not None else None
        return JobContext(self.records, job, delivery.attempt, check, self.stop)

    def failed(self, ctx: JobContext, delivery: Delivery, exc: Exception) -> None:
        """A job that raised: a lost input is recomputed upstream; one too large for the device
        fails at once; anything else is left unacknowledged (redelivered after the idle
        timeout, dead-lettered after max_deliveries) with the error on the record meanwhile."""
        job = ctx.job
        if isinstance(exc, InputLostError):
            ctx.close()
            self._recompute(job, delivery, exc)
            return
        if isinstance(exc, TooLargeError):
            log.error("%s; failing it", exc)
            ctx.close()
            self.records.dead_letter(job, delivery, str(exc))
            return
        log.error("request %s failed in %s", job.request_id, job.stage, exc_info=exc)
        ctx.progress(RecordWrite({Field.ERROR: f"{type(exc).__name__}: {exc}"}))
        ctx.close()

    def result(self, ctx: JobContext, delivery: Delivery, outcome: Outcome,
               seconds: float) -> tuple[StageResult, Outcome]:
        """What is published (or re-queued) for a job that ran to ``outcome``."""
        ctx.close()
        job = ctx.job
        fields = outcome.fields
        if outcome.preempted is not None:  # a publish records the seconds it counts itself
            fields = RecordWrite({StageField.SECONDS.of(job.stage): f"{seconds:.4f}"}) | fields
        routed = (self._router.inbox_for(outcome.affinity)
                  if self._router is not None and outcome.affinity else None)
        return StageResult(job, delivery, outcome.next_job, outcome.state, seconds,
                           fields, routed), outcome

    def _loop(self, idle_ms: int) -> None:
        raise NotImplementedError


class Worker(StageWorker):
    """A stage worker that runs the jobs of each read one after another."""

    handler: Handler

    def _loop(self, idle_ms: int) -> None:
        recovering = False
        # What the last publish took with it (``settle``): a busy worker's next read costs
        # no round trip of its own.
        ahead: list[Delivery] = []
        # A worker asked to stop still runs what it took: those jobs are claimed already.
        while not self.stop.is_set() or ahead:
            try:
                if recovering:
                    # What this worker had in hand when Redis went away is still pending
                    # under its name: take it up again now, not after the idle timeout.
                    deliveries = self.queue.own_pending(self.settings.batch_size)
                    recovering = bool(deliveries)
                elif ahead:
                    deliveries, ahead = ahead, []
                else:
                    deliveries = self.read(self.settings.block_ms, idle_ms,
                                           self.settings.batch_size)
                # One class at a time, interactive first: its results are published before
                # any batch job of the same read starts. The whole read stays leased.
                with self.leases.hold(*deliveries):
                    groups = [list(same) for _, same in
                              itertools.groupby(deliveries, key=lambda d: d.stream)]
                    for i, same_class in enumerate(groups):
                        last = i == len(groups) - 1
                        ahead = self.process(same_class,
                                             self.settings.batch_size if last else 0)
            except REDIS_ERRORS as exc:
                log.warning("Redis error in the %s loop (%s); retrying", self.handler.stage, exc)
                recovering = True
                self.stop.wait(1.0)
                with contextlib.suppress(redis.RedisError):  # logged above; retried next turn
                    self.queue.ensure_group()

    def process(self, deliveries: list[Delivery], take: int = 0) -> list[Delivery]:
        """Fence, run and publish a batch; one round trip to claim and one to publish it
        (and, with ``take``, to read the next: ``settle``)."""
        owned = self.claim(deliveries)
        with self.leases.hold(*(d for _, d in owned)):
            results = [r for job, d in owned if (r := self._run(job, d)) is not None]
        return self.settle(results, take)

    def _run(self, job: Job, delivery: Delivery) -> tuple[StageResult, Outcome] | None:
        """Run the stage for one job; None if it failed (it stays unacknowledged) or went
        back to the stage that produces a lost input."""
        ctx = self.context(job, delivery)
        start = time.perf_counter()
        try:
            outcome = self.through_outages(ctx, lambda: self.handler.handle(ctx))
        except Exception as exc:
            self.failed(ctx, delivery, exc)
            return None
        return self.result(ctx, delivery, outcome, time.perf_counter() - start)
