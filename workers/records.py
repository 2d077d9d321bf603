"""Request records: one Redis hash per request, the single source of truth for its state.

Every state change goes through a Lua script that checks the writer's fencing token (the
delivery attempt it holds), so a worker that was paused past its lease and wakes up can neither
overwrite a newer attempt's progress nor publish a result twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum

import redis

from keys import CfgCache, CfgMode, GenerationSpec, OutputFormat, Priority, PromptSegment
from keys.names import (
    consumer_group,
    dead_letter_stream,
    request_record,
    stage_latency,
    stage_stream,
)
from workers import stage_metrics
from workers.messages import ATTEMPTS_PER_GENERATION, FINISHED, NEXT, RUNNING, Job, State
from workers.streams import Delivery

# KEYS[1] record. ARGV: stage, token, job generation, running state, now, then field pairs.
_CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if tonumber(ARGV[3]) < tonumber(redis.call('HGET', KEYS[1], 'generation') or '0') then
  return 4
end
if state == 'CANCELLED' or state == 'FAILED' or state == 'DONE' then return 3 end
if redis.call('HGET', KEYS[1], 'done:' .. ARGV[1]) then return 2 end
local fence = tonumber(redis.call('HGET', KEYS[1], 'fence:' .. ARGV[1]) or '0')
if tonumber(ARGV[2]) < fence then return 0 end
redis.call('HSET', KEYS[1], 'fence:' .. ARGV[1], ARGV[2], 'state', ARGV[4], 'updated_at', ARGV[5])
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# A writer is current when its token is the stage's fence and its generation is the request's
# (a resume or re-queue since its claim makes it stale). KEYS[1] record; ARGV[1] stage,
# ARGV[2] token.
CURRENT = """
local function current()
  local fence = tonumber(redis.call('HGET', KEYS[1], 'fence:' .. ARGV[1]) or '0')
  local generation = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
  return tonumber(ARGV[2]) == fence
    and math.floor(tonumber(ARGV[2]) / PER_GENERATION) >= generation
end
""".replace("PER_GENERATION", str(ATTEMPTS_PER_GENERATION))

# KEYS[1] record. ARGV: stage, token, now, then field pairs. Returns {state, preempt request}.
_UPDATE = CURRENT + """
if not current() then return {'STALE', ''} end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if #ARGV >= 4 then redis.call('HSET', KEYS[1], 'updated_at', ARGV[3]) end
return {redis.call('HGET', KEYS[1], 'state'), redis.call('HGET', KEYS[1], 'preempt') or ''}
"""

# KEYS: record, this stage's stream, next stage's stream (or the record again for none), the
# stage's latency histogram. ARGV: stage, token, group, entry id, next job ('' for none),
# new state, now, histogram bucket field, seconds, then field pairs.
_PUBLISH = CURRENT + """
if not current() then return 0 end
if redis.call('HGET', KEYS[1], 'done:' .. ARGV[1]) then
  redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
  return 2
end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'CANCELLED' then
  redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
  return 3
end
if ARGV[5] ~= '' then redis.call('XADD', KEYS[3], '*', 'job', ARGV[5]) end
redis.call('HSET', KEYS[1], 'done:' .. ARGV[1], '1', 'state', ARGV[6], 'updated_at', ARGV[7])
-- A preemption asked too late has nothing to stop; an earlier attempt's error or wait is over.
redis.call('HDEL', KEYS[1], 'preempt', 'error', 'waiting')
for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[4], ARGV[8], 1)
redis.call('HINCRBYFLOAT', KEYS[4], 'sum', ARGV[9])
redis.call('HINCRBY', KEYS[4], 'count', 1)
return 1
"""

# KEYS: record, this stage's stream, dead letters. ARGV: group, entry id, job, reason, now,
# job generation. A job of an older generation was superseded: it fails nothing.
_DEAD = """
redis.call('XADD', KEYS[3], '*', 'job', ARGV[3], 'reason', ARGV[4])
local state = redis.call('HGET', KEYS[1], 'state')
local generation = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if state and state ~= 'DONE' and state ~= 'CANCELLED' and tonumber(ARGV[6]) >= generation then
  redis.call('HSET', KEYS[1], 'state', 'FAILED', 'error', ARGV[4], 'updated_at', ARGV[5])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class StageResult:
    """What a stage produced for one delivery, ready to publish."""

    job: Job
    attempt: int
    delivery: Delivery
    next_job: Job | None
    state: State | None
    seconds: float
    fields: dict[str, object]


# KEYS[1] record. ARGV: now. 1 if cancelled, 0 if already finished, -1 if there is no record.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state == 'DONE' or state == 'FAILED' or state == 'CANCELLED' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'CANCELLED', 'updated_at', ARGV[1])
return 1
"""


class Claim(IntEnum):
    MISSING = -1  # no such request
    STALE = 0  # a newer delivery attempt owns the request
    OWNED = 1
    ALREADY_DONE = 2  # this stage already published
    TERMINAL = 3  # cancelled, failed or done
    SUPERSEDED = 4  # the request was re-queued or resumed under a newer entry


class PreemptMode(StrEnum):
    REQUEUE = "requeue"  # back to its stream, to resume on the next free worker
    PARK = "park"  # left PREEMPTED until ``POST /v1/resume``


@dataclass(frozen=True, slots=True)
class Progress:
    """What a progress write learns: the request's state (None if the writer is stale) and
    whether someone asked for it to be preempted."""

    state: State | None
    preempt: PreemptMode | None


class Published(IntEnum):
    STALE = 0
    PUBLISHED = 1
    DUPLICATE = 2
    CANCELLED = 3


def spec_to_json(spec: GenerationSpec) -> str:
    return json.dumps({
        "request_id": spec.request_id, "tenant": spec.tenant,
        "schedule": [[s.prompt, s.negative_prompt, s.until_step, s.guidance_scale]
                     for s in spec.schedule],
        "width": spec.width, "height": spec.height, "num_frames": spec.num_frames,
        "num_inference_steps": spec.num_inference_steps,
        "guidance_scale": spec.guidance_scale, "seed": spec.seed,
        "output_format": spec.output_format.value, "priority": spec.priority.value,
        "cfg_cache": [spec.cfg_cache.mode.value, spec.cfg_cache.interval],
    })


def spec_from_json(raw: str | bytes) -> GenerationSpec:
    """The spec a record holds. Records written before per-segment guidance and the CFG cache
    existed read with their defaults, so requests in flight survive an upgrade."""
    d = json.loads(raw)
    mode, interval = d.get("cfg_cache", [CfgMode.EXACT.value, 1])
    return GenerationSpec(
        request_id=d["request_id"], tenant=d["tenant"],
        schedule=tuple(PromptSegment(p, n, int(u), None if not g or g[0] is None
                                     else float(g[0]))
                       for p, n, u, *g in d["schedule"]),
        width=int(d["width"]), height=int(d["height"]), num_frames=int(d["num_frames"]),
        num_inference_steps=int(d["num_inference_steps"]),
        guidance_scale=float(d["guidance_scale"]), seed=int(d["seed"]),
        output_format=OutputFormat(d["output_format"]), priority=Priority(d["priority"]),
        cfg_cache=CfgCache(CfgMode(mode), int(interval)))


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What a reader of the record sees; ``fields`` keeps everything for status pages."""

    spec: GenerationSpec
    state: State
    step: int
    error: str | None
    output_key: str | None
    fields: dict[str, str]

    def stage_seconds(self) -> dict[str, float]:
        return {k.removeprefix("seconds:"): float(v) for k, v in self.fields.items()
                if k.startswith("seconds:")}

    def hits(self) -> dict[str, int]:
        return {k.removeprefix("hits:"): int(v) for k, v in self.fields.items()
                if k.startswith("hits:")}

    @property
    def generation(self) -> int:
        return int(self.fields.get("generation", "0"))

    def recomputed(self) -> dict[str, int]:
        """Kind -> how many times a lost entry of that kind was made again for this request."""
        return {k.removeprefix("recomputed:"): int(v) for k, v in self.fields.items()
                if k.startswith("recomputed:")}

    def checkpoints(self) -> dict[int, str]:
        """Step -> store key of every checkpoint this request wrote or started from."""
        return {int(k.removeprefix("ckpt:")): v for k, v in self.fields.items()
                if k.startswith("ckpt:")}

    def counter(self, name: str) -> int:
        return int(self.fields.get(name, "0"))


def field_pairs(fields: dict[str, object]) -> list[str]:
    out: list[str] = []
    for k, v in fields.items():
        out += [k, str(v)]
    return out


def timestamp() -> str:
    return f"{time.time():.3f}"


def initial_fields(spec: GenerationSpec) -> dict[str, str]:
    """The record of a request just accepted."""
    now = timestamp()
    return {"spec": spec_to_json(spec), "state": State.QUEUED.value, "step": "0",
            "steps": str(spec.num_inference_steps), "created_at": now, "updated_at": now}


class Records:
    """Reads and fenced writes of request records."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._claim = client.register_script(_CLAIM)
        self._update = client.register_script(_UPDATE)
        self._publish = client.register_script(_PUBLISH)
        self._dead = client.register_script(_DEAD)
        self._cancel = client.register_script(_CANCEL)

    def get(self, tenant: str, request_id: str) -> RequestRecord | None:
        raw = self.redis.hgetall(request_record(tenant, request_id))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]
        return RequestRecord(spec=spec_from_json(fields["spec"]), state=State(fields["state"]),
                             step=int(fields.get("step", "0")), error=fields.get("error"),
                             output_key=fields.get("output_key"), fields=fields)

    def claim_many(self, claims: Sequence[tuple[Job, int, dict[str, object]]]) -> list[Claim]:
        """Fence several jobs in one round trip: each job's claim is checked on its own."""
        pipe = self.redis.pipeline(transaction=False)
        for job, attempt, fields in claims:
            self._claim(keys=[request_record(job.tenant, job.request_id)],
                        args=[job.stage.value, job.fence_token(attempt), job.generation,
                              RUNNING[job.stage].value, timestamp(), *field_pairs(fields)],
                        client=pipe)
        return [Claim(int(code)) for code in pipe.execute()]

    def update(self, job: Job, attempt: int, **fields: object) -> Progress:
        """Write progress if ``attempt`` still owns the request."""
        key = request_record(job.tenant, job.request_id)
        state, preempt = (v.decode() if isinstance(v, bytes) else str(v) for v in self._update(
            keys=[key], args=[job.stage.value, job.fence_token(attempt), timestamp(),
                              *field_pairs(fields)]))
        return Progress(None if state == "STALE" else State(state),
                        PreemptMode(preempt) if preempt else None)

    def publish_many(self, results: Sequence[StageResult]) -> list[Published]:
        """Atomically per job: hand on the next job, record the state and latency, ack.
        All of them travel in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for r in results:
            job = r.job
            key = request_record(job.tenant, job.request_id)
            following = NEXT[job.stage]
            next_stream = stage_stream(following.value, job.priority.value) if following else key
            self._publish(
                keys=[key, r.delivery.stream, next_stream, stage_latency(job.stage.value)],
                args=[job.stage.value, job.fence_token(r.attempt),
                      consumer_group(job.stage.value), r.delivery.entry_id,
                      r.next_job.to_json() if r.next_job else "",
                      (r.state or FINISHED[job.stage]).value, timestamp(),
                      stage_metrics.bucket_field(r.seconds), f"{r.seconds:.6f}",
                      *field_pairs(r.fields)], client=pipe)
        return [Published(int(code)) for code in pipe.execute()]

    def dead_letter(self, job: Job, delivery: Delivery, reason: str) -> None:
        self._dead(keys=[request_record(job.tenant, job.request_id), delivery.stream,
                         dead_letter_stream()],
                   args=[consumer_group(job.stage.value), delivery.entry_id, job.to_json(),
                         reason, timestamp(), job.generation])

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Ask workers to stop at the next step boundary; False if already finished.

        One script, so a request that finishes at the same moment is never marked CANCELLED
        after DONE."""
        return int(self._cancel(keys=[request_record(tenant, request_id)], args=[timestamp()])) == 1
