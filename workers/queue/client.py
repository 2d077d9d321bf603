"""The queue side as its callers see it: submit (through admission), get, cancel, preempt,
resume in place, follow, whether each stage has live workers, and the cluster-wide view that
dashboards and scrapes read.

The API and ``diffcache submit`` both go through this one client, so a request is admitted,
looked up and moved between states the same way whichever door it came in by.
"""

from __future__ import annotations

from collections.abc import Iterator

from cachesvc.redis_client import RedisClient
from keys import GenerationSpec
from keys.spec import valid_request_id
from workers.queue.admission import Admission, Limits
from workers.queue.cluster_view import ClusterView
from workers.queue.events import RecordEvents
from workers.queue.heartbeats import live_workers
from workers.queue.lifecycle import Lifecycle, LifecycleError
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import PreemptMode, RequestRecord
from workers.queue.served_model import ServedModel

# A worker beats every workers.heartbeat_s; one silent for this long is taken for gone.
HEARTBEAT_WITHIN_S = 5.0


class UnknownRequestError(LookupError):
    """No request of this tenant has that id (or its record has expired)."""


class NotReadyError(RuntimeError):
    """The request is in a state that does not allow what was asked."""

    def __init__(self, record: RequestRecord, why: str = "") -> None:
        super().__init__(f"request {record.spec.request_id} is {record.state.value}"
                         + (f": {why}" if why else ""))
        self.record = record


class QueueClient:
    """Requests in the queue, for one deployment's limits."""

    def __init__(self, client: RedisClient, limits: Limits) -> None:
        # Built once: they register their Lua scripts with the client.
        self.redis = client
        self.admission = Admission(client, limits)
        self.records = Records(client)
        self.lifecycle = Lifecycle(client)
        self.events = RecordEvents(client)
        self.view = ClusterView(client)

    def served(self) -> ServedModel:
        """The model the workers serve; NotPublishedError before any has said."""
        return self.admission.served()

    def submit(self, spec: GenerationSpec, model: ServedModel) -> str:
        """Submit a request already checked by ``admission``; QueueFullError over a bound."""
        return self.admission.submit(spec, model)

    def get(self, tenant: str, request_id: str) -> RequestRecord:
        record = self.records.get(tenant, request_id) if valid_request_id(request_id) else None
        if record is None:
            raise UnknownRequestError(f"no request {request_id}")
        return record

    def cancel(self, tenant: str, request_id: str) -> RequestRecord:
        record = self.get(tenant, request_id)
        if not self.records.cancel(tenant, request_id):
            raise NotReadyError(record)
        return self.get(tenant, request_id)

    def preempt(self, tenant: str, request_id: str, mode: PreemptMode) -> RequestRecord:
        """Ask the denoise worker to checkpoint and step aside; NotReadyError unless
        denoising."""
        record = self.get(tenant, request_id)
        if not self.lifecycle.ask_preempt(tenant, request_id, mode):
            raise NotReadyError(record, "only a DENOISING request can be preempted")
        return self.get(tenant, request_id)

    def resume(self, record: RequestRecord) -> str:
        """Resume a PREEMPTED, FAILED or CANCELLED request in place, from its latest
        checkpoint; admitted again like a new request (QueueFullError over a bound)."""
        if not record.state.resumable:
            raise NotReadyError(record, "only a PREEMPTED, FAILED or CANCELLED request can "
                                "be resumed")
        # Counted before the resume, so it is refused like a new request when over a bound.
        # Should the resume then fail, the next admission drops it again by its state.
        self.admission.readmit(record.spec)
        try:
            self.lifecycle.resume(record)
        except LifecycleError as exc:
            raise NotReadyError(record, str(exc)) from exc
        # Until the resume, the request was PREEMPTED, FAILED or CANCELLED, and another
        # admission may have dropped it from the count meanwhile: count it once more.
        self.admission.readmit(record.spec, bounded=False)
        return record.spec.request_id

    def recompute_output(self, record: RequestRecord) -> None:
        """Make a DONE request's lost output again from its record; NotReadyError when it is
        no longer DONE (another caller got there first, or it was deleted)."""
        if not self.lifecycle.recompute_output(record):
            raise NotReadyError(self.get(record.spec.tenant, record.spec.request_id))

    def follow(self, tenant: str, request_id: str, timeout_s: float,
               reread_s: float | None = None) -> Iterator[RequestRecord]:
        """The record at each change until it settles: see ``RecordEvents.follow``."""
        return self.events.follow(tenant, request_id, timeout_s, reread_s)

    def stages_live(self) -> dict[Stage, bool]:
        """Whether each stage has a worker that beat its heartbeat lately."""
        return {stage: bool(live_workers(self.redis, stage, within_s=HEARTBEAT_WITHIN_S))
                for stage in Stage}

    def close(self) -> None:
        self.events.close()
