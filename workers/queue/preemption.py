"""When batch work makes way for interactive work.

A denoise worker whose engine is full looks, at each step boundary, for interactive work of its
stage that has waited past a grace period (none by default). If some has, it reads the entry
itself, which no other worker can then read, and its batch run that joined last makes way for
it. Jobs already re-queued or resumed ``max_preemptions`` times are left to finish.
"""

from __future__ import annotations

import time

from cachesvc.redis_client import RedisClient
from config.settings import WorkerSettings
from keys import Priority
from workers.queue.messages import Job, Stage
from workers.queue.runtime import PreemptCheck
from workers.queue.schema import PreemptMode
from workers.queue.streams import oldest_waiting


class InteractiveWaiting:
    def __init__(self, client: RedisClient, stage: Stage, settings: WorkerSettings) -> None:
        self.redis = client
        self.stage = stage
        self.grace_ms = settings.preempt_grace_ms
        self.max_preemptions = settings.max_preemptions

    def check_for(self, job: Job) -> PreemptCheck | None:
        """The check to run while ``job`` is in hand; None if it may not be preempted."""
        if job.priority is not Priority.BATCH or job.generation >= self.max_preemptions:
            return None
        return self._check

    def _check(self) -> PreemptMode | None:
        """Whether interactive work has waited past the grace (with none, whether it may have:
        the worker's read finds out, at no extra round trip)."""
        if not self.grace_ms:
            return PreemptMode.REQUEUE
        entry = oldest_waiting(self.redis, self.stage, Priority.INTERACTIVE)
        if entry is None:
            return None
        waited_ms = time.time() * 1000 - int(entry.split("-")[0])
        return PreemptMode.REQUEUE if waited_ms >= self.grace_ms else None
