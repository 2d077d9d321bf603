"""Preemption and resume: the transitions that take a request off a worker and put it back.

A preempted job writes a checkpoint and is re-queued under a new generation (or parked), which
is not a failed delivery; ``resume`` puts a preempted, cancelled or failed request back at the
encode stage, from where denoise continues at its latest checkpoint.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum

import redis
from redis.commands.core import Script

from keys import KeyKind
from keys.names import consumer_group, decode_credits, request_record, stage_stream
from workers.messages import FINISHED, PREVIOUS, Job, Stage, State
from workers.records import CURRENT, PreemptMode, RequestRecord, field_pairs, timestamp
from workers.streams import Delivery
from workers.submit import run_durably

# KEYS[1] record. ARGV: mode, now. 1 if asked, 0 if the request is not denoising, -1 if missing.
_ASK = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'DENOISING' then return 0 end
redis.call('HSET', KEYS[1], 'preempt', ARGV[1], 'updated_at', ARGV[2])
return 1
"""

# KEYS: record, the delivery's stream, the stream to re-queue on, decode credits.
# ARGV: stage, token, group, entry id, new job ('' to park), new generation, now, field pairs.
_REQUEUE = CURRENT + """
if not current() then return 0 end
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
if redis.call('HGET', KEYS[1], 'state') == 'CANCELLED' then return 3 end
redis.call('HDEL', KEYS[1], 'preempt')
redis.call('HINCRBY', KEYS[1], 'preemptions', 1)
redis.call('ZREM', KEYS[4], KEYS[1])
local state = 'PREEMPTED'
if ARGV[5] ~= '' then
  redis.call('XADD', KEYS[3], '*', 'job', ARGV[5])
  state = 'ENCODED'
end
redis.call('HSET', KEYS[1], 'state', state, 'generation', ARGV[6], 'updated_at', ARGV[7])
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: record, the encode stream. ARGV: new generation, job, now.
_RESUME = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'PREEMPTED' and state ~= 'FAILED' and state ~= 'CANCELLED' then return 0 end
local generation = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if generation + 1 ~= tonumber(ARGV[1]) then return -2 end
redis.call('HDEL', KEYS[1], 'done:encode', 'done:denoise', 'done:decode', 'error', 'output_key',
           'preempt')
redis.call('HINCRBY', KEYS[1], 'resumes', 1)
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'generation', ARGV[1], 'updated_at', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
return 1
"""


# KEYS: record, the delivery's stream, the producing stage's stream, decode credits.
# ARGV: stage, token, group, entry id, job, new generation, now, lost kind, max recomputes,
# state to set, error if over the bound, then the done:<stage> fields to clear.
_RECOMPUTE = CURRENT + """
if not current() then return 0 end
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'CANCELLED' or state == 'DONE' or state == 'FAILED' then return 3 end
redis.call('ZREM', KEYS[4], KEYS[1])
redis.call('HINCRBY', KEYS[1], 'recomputed:' .. ARGV[8], 1)
if redis.call('HINCRBY', KEYS[1], 'recomputes', 1) > tonumber(ARGV[9]) then
  redis.call('HSET', KEYS[1], 'state', 'FAILED', 'error', ARGV[11], 'updated_at', ARGV[7])
  return 2
end
for i = 12, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
redis.call('XADD', KEYS[3], '*', 'job', ARGV[5])
redis.call('HSET', KEYS[1], 'state', ARGV[10], 'generation', ARGV[6], 'updated_at', ARGV[7])
return 1
"""

# KEYS: record, the encode stream. ARGV: new generation, job, now. A DONE request whose output
# was lost goes through the pipeline again: its seed makes the output the same.
_REDO_OUTPUT = """
if redis.call('HGET', KEYS[1], 'state') ~= 'DONE' then return 0 end
local generation = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if generation + 1 ~= tonumber(ARGV[1]) then return 0 end
redis.call('HDEL', KEYS[1], 'done:encode', 'done:denoise', 'done:decode', 'output_key')
redis.call('HINCRBY', KEYS[1], 'recomputed:output', 1)
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'generation', ARGV[1], 'updated_at', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
return 1
"""


class Recomputed(IntEnum):
    STALE = 0  # a newer delivery owns the request: nothing written
    QUEUED = 1  # the producing stage has the request again
    OVER_BOUND = 2  # the store keeps losing this request's entries: FAILED
    FINISHED = 3  # cancelled or finished meanwhile: acknowledged only


class Requeued(IntEnum):
    STALE = 0  # a newer delivery owns the request: nothing written
    DONE = 1
    CANCELLED = 3  # cancelled meanwhile: acknowledged, not re-queued


class LifecycleError(RuntimeError):
    """The request cannot be preempted or resumed as asked; names the request and why."""


class Lifecycle:
    """The fenced scripts that take a request off a worker and put it back."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._ask = client.register_script(_ASK)
        self._requeue = client.register_script(_REQUEUE)
        self._resume = client.register_script(_RESUME)
        self._recompute = client.register_script(_RECOMPUTE)
        self._redo_output = client.register_script(_REDO_OUTPUT)

    def ask_preempt(self, tenant: str, request_id: str, mode: PreemptMode) -> bool:
        """Ask the worker denoising the request to stop at its next step boundary; False if
        the request is not denoising."""
        code = int(self._ask(keys=[request_record(tenant, request_id)],
                             args=[mode.value, timestamp()]))
        if code < 0:
            raise LifecycleError(f"request {request_id} does not exist")
        return code == 1

    def requeue(self, job: Job, delivery: Delivery, mode: PreemptMode,
                fields: dict[str, object]) -> Requeued:
        """Hand a preempted job back: a new entry (or none, to park), the old one acked, its
        decode credit released, all in one script fenced by the delivery's token."""
        following = dataclasses.replace(job, generation=job.generation + 1)
        record = request_record(job.tenant, job.request_id)
        code = self._requeue(
            keys=[record, delivery.stream, stage_stream(job.stage.value, job.priority.value),
                  decode_credits()],
            args=[job.stage.value, job.fence_token(delivery.attempt),
                  consumer_group(job.stage.value), delivery.entry_id,
                  following.to_json() if mode is PreemptMode.REQUEUE else "",
                  following.generation, timestamp(), *field_pairs(fields)])
        return Requeued(int(code))

    def resume(self, record: RequestRecord) -> None:
        """Put a preempted, cancelled or failed request back in the encode stream, durably."""
        spec = record.spec
        if not record.state.resumable:
            raise LifecycleError(f"request {spec.request_id} is {record.state.value}; only "
                              f"{', '.join(s.value for s in State if s.resumable)} requests "
                              "can be resumed")
        if self._back_to_encode(record, self._resume) != 1:
            raise LifecycleError(f"request {spec.request_id} changed while resuming it; "
                              "read its state and try again")

    def recompute(self, job: Job, delivery: Delivery, redo: Job, lost: KeyKind,
                  max_recomputes: int) -> Recomputed:
        """Send the request back to ``redo.stage``, which produces the lost input, under the
        next generation: neither a failed delivery nor a preemption. Past ``max_recomputes``
        the request fails, naming the kind the store kept losing."""
        following = dataclasses.replace(redo, generation=job.generation + 1)
        stages = list(Stage)
        cleared = [f"done:{s.value}" for s in stages[stages.index(redo.stage):]]
        waiting = State.QUEUED if redo.stage is Stage.ENCODE else FINISHED[PREVIOUS[redo.stage]]
        code = self._recompute(
            keys=[request_record(job.tenant, job.request_id), delivery.stream,
                  stage_stream(redo.stage.value, job.priority.value), decode_credits()],
            args=[job.stage.value, job.fence_token(delivery.attempt),
                  consumer_group(job.stage.value), delivery.entry_id, following.to_json(),
                  following.generation, timestamp(), lost.value, max_recomputes,
                  waiting.value, f"the store lost this request's {lost.value} entries more "
                  f"than {max_recomputes} times (workers.max_recomputes)", *cleared])
        return Recomputed(int(code))

    def recompute_output(self, record: RequestRecord) -> bool:
        """Run a DONE request whose output was lost through the pipeline again (it is seeded,
        so the output is the same); False if it changed meanwhile."""
        return self._back_to_encode(record, self._redo_output) == 1

    def _back_to_encode(self, record: RequestRecord, script: Script) -> int:
        """Run ``script`` (KEYS: record, encode stream; ARGV: new generation, job, now),
        which puts the request at encode under its next generation, durably."""
        spec = record.spec
        job = Job(spec.request_id, spec.tenant, Stage.ENCODE, priority=spec.priority,
                  generation=record.generation + 1)
        (code,) = run_durably(self.redis, spec.request_id, lambda pipe: script(
            keys=[request_record(spec.tenant, spec.request_id),
                  stage_stream(Stage.ENCODE.value, spec.priority.value)],
            args=[job.generation, job.to_json(), timestamp()], client=pipe))
        return int(code)
