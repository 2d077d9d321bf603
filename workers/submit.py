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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.client import Pipeline

from keys import GenerationSpec
from keys.names import (
    active_requests,
    request_index,
    request_record,
    stage_stream,
    tenant_active_requests,
)
from workers.messages import Job, Stage
from workers.records import initial_fields

# Admission, shared by both scripts. KEYS[1] is the record, KEYS[2] and KEYS[3] the overall and
# the tenant's active sets; ARGV[1] is the score, ARGV[2] and ARGV[3] the bounds (-1: none).
# Members are dropped once their request stops counting, as decode credits are. Unbounded, only
# the oldest few are looked at, so callers without bounds pay O(1) yet the sets cannot grow
# without limit.
_ADMISSION = """
local function live(set, bounded)
  local last = -1
  if not bounded then last = 31 end
  for _, member in ipairs(redis.call('ZRANGE', set, 0, last)) do
    local state = redis.call('HGET', member, 'state')
    if not state or state == 'DONE' or state == 'FAILED' or state == 'CANCELLED'
       or state == 'PREEMPTED' then
      redis.call('ZREM', set, member)
    end
  end
  return redis.call('ZCARD', set)
end
local function admit()
  local cap, tenant_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
  local tenant_live = live(KEYS[3], tenant_cap >= 0)
  if tenant_cap >= 0 and tenant_live >= tenant_cap then return -2 end
  local overall_live = live(KEYS[2], cap >= 0)
  if cap >= 0 and overall_live >= cap then return -1 end
  redis.call('ZADD', KEYS[2], ARGV[1], KEYS[1])
  redis.call('ZADD', KEYS[3], ARGV[1], KEYS[1])
  return 1
end
"""

# KEYS: record, active, tenant active, index, encode stream.
# ARGV: score, bound, tenant bound, job, request id, then field/value pairs.
# 1: accepted; 0: seen before; -1: over the overall bound; -2: over the tenant's bound.
_SUBMIT = _ADMISSION + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local admitted = admit()
if admitted ~= 1 then return admitted end
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[4], ARGV[1], ARGV[5])
redis.call('XADD', KEYS[5], '*', 'job', ARGV[4])
return 1
"""

# KEYS and ARGV as _ADMISSION: count an existing request as active again (before a resume).
_READMIT = _ADMISSION + "return admit()"
_REFUSED = (-1, -2)  # over the overall bound, over the tenant's bound


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


def _refused(code: int, spec: GenerationSpec, bounds: Bounds) -> AdmissionError:
    bound: Literal["overall", "tenant"] = "overall" if code == -1 else "tenant"
    limit = bounds.max_active if bound == "overall" else bounds.max_active_per_tenant
    return AdmissionError(spec.request_id, spec.tenant, bound, limit or 0)


class DurabilityError(RuntimeError):
    """The server could not confirm that an accepted request is on disk."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def _admission_keys(tenant: str, request_id: str) -> list[str]:
    return [request_record(tenant, request_id), active_requests(), tenant_active_requests(tenant)]


def submit(client: redis.Redis, spec: GenerationSpec, *, durable_timeout_ms: int = 2000,
           bounds: Bounds = UNBOUNDED, fields: Mapping[str, str] | None = None) -> str:
    """Accept ``spec`` and return its request id; a request id seen before is not re-queued.

    Raises AdmissionError, having written nothing, when ``bounds`` would be exceeded.
    ``fields`` go into the record too (the model that serves it).
    """
    record = {**initial_fields(spec), **(fields or {})}
    job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority)
    args: list[str | int] = [int(time.time() * 1000), *bounds.args(), job.to_json(),
                             spec.request_id]
    for k, v in record.items():
        args += [k, v]
    script = client.register_script(_SUBMIT)
    (code, *_) = run_durably(client, spec.request_id, lambda pipe: script(
        keys=[*_admission_keys(spec.tenant, spec.request_id), request_index(spec.tenant),
              stage_stream(Stage.ENCODE.value, spec.priority.value)], args=args, client=pipe),
        durable_timeout_ms)
    if int(code) in _REFUSED:
        raise _refused(int(code), spec, bounds)
    return spec.request_id


def readmit(client: redis.Redis, spec: GenerationSpec, bounds: Bounds = UNBOUNDED) -> None:
    """Count an existing request as queued or running again, as a resume is about to make it.

    Raises AdmissionError when ``bounds`` would be exceeded. Until the resume has moved the
    request out of PREEMPTED, FAILED or CANCELLED, a concurrent admission may drop it again, so
    call this once more, unbounded, after the resume.
    """
    script = client.register_script(_READMIT)
    code = int(script(keys=_admission_keys(spec.tenant, spec.request_id),
                      args=[int(time.time() * 1000), *bounds.args()]))
    if code in _REFUSED:
        raise _refused(code, spec, bounds)


def run_durably(client: redis.Redis, request_id: str, write: Callable[[Pipeline], object],
                timeout_ms: int = 2000) -> list[Any]:
    """Run the commands ``write`` queues, then wait until the server has fsynced them.

    WAITAOF covers the writes of its own connection, so both travel in one pipeline.
    Returns the results of the queued commands.
    """
    pipe = client.pipeline(transaction=False)
    write(pipe)
    pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
    *results, waited = pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, Exception):
            raise result
    if isinstance(waited, Exception):
        raise DurabilityError(f"request {request_id} was written but the server cannot "
                              f"confirm it is durable ({waited}); enable appendonly")
    if int(waited[0]) < 1:
        raise DurabilityError(f"request {request_id} not fsynced within {timeout_ms} ms")
    return results
