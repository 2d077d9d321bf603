"""Accepting a request: its record and its first stream entry, durable before we answer.

Both are written in one Lua script, so a crash never leaves a record without its job or a job
without its record. ``WAITAOF`` then waits until the server has fsynced them to its AOF.
Submitting the same request id twice is a no-op that returns the existing request. The same
script admits the request against optional bounds on queued plus running requests (overall and
per tenant), so concurrent submits can never overshoot them.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis import ConnectionPool
from redis.client import Pipeline
from redis.cluster import RedisCluster

from cachesvc.redis_client import RedisClient, slot_server
from keys import GenerationSpec
from keys.names import (
    QUEUE_TAG,
    active_requests,
    request_index,
    request_record,
    stage_stream,
    tenant_active_requests,
)
from workers.queue.messages import Job, Stage
from workers.queue.queue_server import queue_server
from workers.queue.record_write import NOTHING, RecordWrite
from workers.queue.records import initial_fields
from workers.queue.schema import timestamp
from workers.queue.script_args import ReadmitArgs, SubmitArgs
from workers.queue.script_library import Result
from workers.queue.scripts import Scripts, execute


@dataclass(frozen=True)
class Bounds:
    """Bounds on queued plus running requests; None is unbounded."""

    max_active: int | None = None
    max_active_per_tenant: int | None = None

    def args(self) -> list[int]:
        return [-1 if b is None else b for b in (self.max_active, self.max_active_per_tenant)]


UNBOUNDED = Bounds()


class AdmissionError(RuntimeError):
    """Admitting a request would exceed a bound; nothing was written. Retry later."""

    def __init__(self, request_id: str, tenant: str, bound: Literal["overall", "tenant"],
                 limit: int) -> None:
        whose = f"tenant {tenant} has" if bound == "tenant" else "the cluster has"
        super().__init__(f"request {request_id} not admitted: {whose} {limit} or more "
                         "requests queued or running")
        self.request_id = request_id
        self.tenant = tenant
        self.bound = bound
        self.limit = limit


_REFUSED = (Result.OVER_BOUND, Result.OVER_TENANT_BOUND)


def _refused(result: Result, spec: GenerationSpec, bounds: Bounds) -> AdmissionError:
    bound: Literal["overall", "tenant"] = "overall" if result is Result.OVER_BOUND else "tenant"
    limit = bounds.max_active if bound == "overall" else bounds.max_active_per_tenant
    return AdmissionError(spec.request_id, spec.tenant, bound, limit or 0)


class DurabilityError(RuntimeError):
    """The server could not confirm that an accepted request is on disk (and, on a Redis
    Cluster, on a replica)."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def submit(client: RedisClient, spec: GenerationSpec, *, durable_timeout_ms: int = 2000,
           bounds: Bounds = UNBOUNDED, fields: RecordWrite = NOTHING) -> str:
    """Accept ``spec`` and return its request id; a request id seen before is not re-queued.

    Raises AdmissionError, having written nothing, when ``bounds`` would be exceeded.
    ``fields`` go into the record too (the model that serves it).
    """
    job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority)
    bound, tenant_bound = bounds.args()
    args = SubmitArgs(request_record(spec.tenant, spec.request_id), active_requests(),
                      tenant_active_requests(spec.tenant), request_index(spec.tenant),
                      stage_stream(Stage.ENCODE.value, spec.priority.value),
                      int(time.time() * 1000), bound, tenant_bound, job.to_json(), spec.request_id,
                      timestamp(), initial_fields(spec) | fields)
    (code, *_) = run_durably(client, spec.request_id,
                             lambda pipe: Scripts(client).run(args, pipe), durable_timeout_ms)
    if (result := Result(int(code))) in _REFUSED:
        raise _refused(result, spec, bounds)
    return spec.request_id


def readmit(client: RedisClient, spec: GenerationSpec, bounds: Bounds = UNBOUNDED) -> None:
    """Count an existing request as queued or running again, as a resume is about to make it.

    Raises AdmissionError when ``bounds`` would be exceeded. Until the resume has moved the
    request out of PREEMPTED, FAILED or CANCELLED, a concurrent admission may drop it again, so
    call this once more, unbounded, after the resume.
    """
    bound, tenant_bound = bounds.args()
    result = Scripts(client).result(ReadmitArgs(
        request_record(spec.tenant, spec.request_id), active_requests(),
        tenant_active_requests(spec.tenant), int(time.time() * 1000), bound, tenant_bound))
    if result in _REFUSED:
        raise _refused(result, spec, bounds)


def run_durably(client: RedisClient, request_id: str, write: Callable[[Pipeline], object],
                timeout_ms: int = 2000) -> list[Any]:
    """Run the commands ``write`` queues on the queue's server, then wait until it has
    fsynced them and, on a Redis Cluster, until a replica holds them too, so that a failover
    keeps what was accepted. Returns the results of the queued commands.

    WAITAOF and WAIT cover the writes of their own connection: all travel in one pipeline to
    the queue's server (``queue_server``). The replica is waited for with WAIT, not WAITAOF: a
    replica acknowledges its fsync only once a second, and the replica a failover promotes is
    alive, with the write in memory. How many replicas to wait for is what the server's ROLE
    said at the last acceptance: when the replica is down, one acceptance waits out
    ``timeout_ms`` and those after it take the master's fsync alone, until ROLE shows a
    replica again.
    """
    cluster = isinstance(client, RedisCluster)
    default_replicas = min(slot_server(client, QUEUE_TAG).replicas, 1)  # from the layout
    expected: list[int] = []

    def queue(pipe: Pipeline) -> None:
        write(pipe)
        pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
        if cluster:
            expected[:] = [_REPLICAS.get(pipe.connection_pool, default_replicas)]
            pipe.execute_command("ROLE")
            pipe.execute_command("WAIT", expected[0], timeout_ms)

    results = execute(client, queue)
    waits = [results.pop() for _ in range(3 if cluster else 1)][::-1]
    for result in results:
        if isinstance(result, Exception):
            raise result
    for waited in waits:
        if isinstance(waited, Exception):
            # The server says why (WAITAOF names appendonly when it is off).
            raise DurabilityError(f"request {request_id} was written but the server cannot "
                                  f"confirm it is durable: {waited}")
    fsynced = waits[0]
    if int(fsynced[0]) < 1:
        raise DurabilityError(f"request {request_id} not fsynced within {timeout_ms} ms")
    if cluster:
        role, replicated = waits[1], int(waits[2])
        connected = min(len(role[2]), 1) if role[0] == b"master" else 0
        _REPLICAS[queue_server(client).connection_pool] = connected
        if replicated < min(expected[0], connected):
            raise DurabilityError(f"request {request_id} not on a replica within "
                                  f"{timeout_ms} ms")
    return results


# Replicas (0 or 1) each queue server had connected at its last acceptance.
_REPLICAS: weakref.WeakKeyDictionary[ConnectionPool, int] = weakref.WeakKeyDictionary()
