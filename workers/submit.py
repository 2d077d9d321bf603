"""Accepting a request: its record and its first stream entry, durable before we answer.

Both are written in one Lua script, so a crash never leaves a record without its job or a job
without its record. ``WAITAOF`` then waits until the server has fsynced them to its AOF.
Submitting the same request id twice is a no-op that returns the existing request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline

from keys import GenerationSpec
from keys.names import request_index, request_record, stage_stream
from workers.messages import Job, Stage
from workers.records import initial_fields

# KEYS: record, index, encode stream. ARGV: score, job, request id, then field/value pairs.
_SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[3])
redis.call('XADD', KEYS[3], '*', 'job', ARGV[2])
return 1
"""


class DurabilityError(RuntimeError):
    """The server could not confirm that an accepted request is on disk."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def submit(client: redis.Redis, spec: GenerationSpec, *, durable_timeout_ms: int = 2000) -> str:
    """Accept ``spec`` and return its request id; a request id seen before is not re-queued."""
    fields = initial_fields(spec)
    job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority)
    args: list[str] = [str(int(time.time() * 1000)), job.to_json(), spec.request_id]
    for k, v in fields.items():
        args += [k, v]
    script = client.register_script(_SUBMIT)
    run_durably(client, spec.request_id, lambda pipe: script(
        keys=[request_record(spec.tenant, spec.request_id), request_index(spec.tenant),
              stage_stream(Stage.ENCODE.value, spec.priority.value)], args=args, client=pipe),
        durable_timeout_ms)
    return spec.request_id


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
