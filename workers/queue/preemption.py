"""When batch work makes way for interactive work.

A worker running a batch job asks, from its progress thread, whether an interactive entry of
its stage has waited past a short grace period; if it has, the worker takes that entry's ticket
(at most one preemption per waiting entry, whichever worker wins) and stops at its next step
boundary. Jobs already re-queued or resumed ``max_preemptions`` times are left to finish.
"""

from __future__ import annotations

import time

import redis

from cachesvc.settings import WorkerSettings
from keys import Priority
from keys.names import preempt_ticket
from workers.queue.messages import Job, Stage
from workers.queue.runtime import PreemptCheck
from workers.queue.schema import PreemptMode
from workers.queue.streams import oldest_waiting

TICKET_TTL_MS = 60_000


class InteractiveWaiting:
    def __init__(self, client: redis.Redis, stage: Stage, consumer: str,
                 settings: WorkerSettings) -> None:
        self.redis = client
        self.stage = stage
        self.consumer = consumer
        self.grace_ms = settings.preempt_grace_ms
        self.max_preemptions = settings.max_preemptions

    def check_for(self, job: Job) -> PreemptCheck | None:
        """The check to run while ``job`` is in hand; None if it may not be preempted."""
        if job.priority is not Priority.BATCH or job.generation >= self.max_preemptions:
            return None
        return self._check

    def _check(self) -> PreemptMode | None:
        entry = oldest_waiting(self.redis, self.stage, Priority.INTERACTIVE)
        if entry is None:
            return None
        waited_ms = time.time() * 1000 - int(entry.split("-")[0])
        if waited_ms < self.grace_ms:
            return None
        won = self.redis.set(preempt_ticket(entry), self.consumer, nx=True, px=TICKET_TTL_MS)
        return PreemptMode.REQUEUE if won else None
