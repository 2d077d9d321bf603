"""What the API does with a request, apart from HTTP: canonicalize, admit, submit, look up.

It holds the Redis client and the store connection, and talks to workers only through
``workers.submit``, ``workers.records``, ``workers.lifecycle`` and ``workers.streams``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import redis
import xxhash

from api.editing import branch_point, branched_spec, cfg_cache_from, segments_from
from api.schemas import FieldError, GenerateBody, RequestStatus, ResumeBody, check_limits
from cachesvc.errors import StoreUnavailableError
from cachesvc.settings import Settings
from cachesvc.tensor_cache import TensorCache
from keys import GenerationSpec, KeyKind, StoreKey
from keys.names import KEY_VERSION, check_tenant
from keys.spec import valid_request_id
from workers.lifecycle import Lifecycle, LifecycleError
from workers.messages import Stage, State
from workers.records import PreemptMode, Records, RequestRecord
from workers.streams import live_consumers, queue_counts
from workers.submit import new_request_id, submit

IDEMPOTENCY_TTL_S = 24 * 3600


class QueueFullError(RuntimeError):
    """More work is queued than the configured bound; the client should retry later."""


class NotFoundError(LookupError):
    pass


class NotReadyError(RuntimeError):
    """The request is in a state that does not allow what was asked."""

    def __init__(self, record: RequestRecord, why: str = "") -> None:
        super().__init__(f"request {record.spec.request_id} is {record.state.value}"
                         + (f": {why}" if why else ""))
        self.record = record


class GoneError(RuntimeError):
    pass


class WaitTimeoutError(TimeoutError):
    """A synchronous endpoint waited longer than ``api.sync_timeout_s``."""


def idempotency_key(tenant: str, key: str) -> str:
    return f"{KEY_VERSION}:{check_tenant(tenant)}:idem:{xxhash.xxh3_128_hexdigest(key.encode())}"


def status_of(record: RequestRecord) -> RequestStatus:
    spec = record.spec
    return RequestStatus(
        id=spec.request_id, state=record.state.value, step=record.step,
        steps=spec.num_inference_steps, output_format=spec.output_format.value,
        priority=spec.priority.value, stage_seconds=record.stage_seconds(),
        cache_hits=record.hits(), resumed_from=record.counter("resumed_from"),
        checkpoints=sorted(record.checkpoints()), preemptions=record.counter("preemptions"),
        error=record.error,
        created_at=float(record.fields["created_at"]),
        updated_at=float(record.fields["updated_at"]))


@dataclass
class Service:
    settings: Settings
    redis: redis.Redis
    cache: TensorCache
    records: Records = field(init=False)
    lifecycle: Lifecycle = field(init=False)

    def __post_init__(self) -> None:
        # Built once: both register their Lua scripts with the client.
        self.records = Records(self.redis)
        self.lifecycle = Lifecycle(self.redis)

    def spec_for(self, tenant: str, body: GenerateBody) -> GenerationSpec:
        m = self.settings.model

        def given(value: int | None, default: int) -> int:
            return default if value is None else value

        if (body.prompt is None) == (body.schedule is None):
            raise FieldError("prompt", "give either prompt or schedule (exactly one)")
        width, height = given(body.width, m.width), given(body.height, m.height)
        frames = given(body.num_frames, m.num_frames)
        default_steps = body.schedule[-1].until_step if body.schedule else m.num_inference_steps
        steps = given(body.num_inference_steps, default_steps)
        check_limits(body, width, height, frames, steps, self.settings.api)
        schedule = None
        if body.schedule is not None:
            schedule = segments_from(body.schedule, body.negative_prompt, "schedule", 0, steps)
        return GenerationSpec.create(
            request_id=new_request_id(), tenant=tenant, prompt=body.prompt or "",
            negative_prompt=body.negative_prompt, schedule=schedule, width=width, height=height,
            num_frames=frames, num_inference_steps=steps,
            guidance_scale=m.guidance_scale if body.guidance_scale is None
            else body.guidance_scale,
            seed=secrets.randbelow(2**31) if body.seed is None else body.seed,
            output_format=body.output_format, priority=body.priority,
            cfg_cache=cfg_cache_from(body.cfg_cache))

    def queue_depth(self) -> dict[str, int]:
        """Jobs waiting or running per stage, over every priority class."""
        depth = dict.fromkeys((stage.value for stage in Stage), 0)
        for (stage, _), counts in queue_counts(self.redis).items():
            depth[stage.value] += sum(counts)
        return depth

    def generate(self, tenant: str, body: GenerateBody, idem: str | None = None) -> str:
        """Admit and submit; with an idempotency key, a repeat returns the first request."""
        if idem is not None:
            existing = self.redis.get(idempotency_key(tenant, idem))
            if existing is not None:
                return existing.decode()  # type: ignore[union-attr]
        spec = self.spec_for(tenant, body)
        if sum(self.queue_depth().values()) >= self.settings.api.max_queue_depth:
            raise QueueFullError(f"{self.settings.api.max_queue_depth} or more jobs are queued "
                                 "or running (api.max_queue_depth)")
        # First writer wins; a concurrent duplicate gets the winner's id.
        if idem is not None and not self.redis.set(idempotency_key(tenant, idem),
                                                   spec.request_id, nx=True,
                                                   ex=IDEMPOTENCY_TTL_S):
            winner = self.redis.get(idempotency_key(tenant, idem))
            return winner.decode()  # type: ignore[union-attr]
        return submit(self.redis, spec)

    def record(self, tenant: str, request_id: str) -> RequestRecord:
        record = self.records.get(tenant, request_id) if valid_request_id(request_id) else None
        if record is None:
            raise NotFoundError(f"no request {request_id}")
        return record

    def result(self, tenant: str, request_id: str) -> tuple[RequestRecord, bytes]:
        record = self.record(tenant, request_id)
        if record.state is not State.DONE or record.output_key is None:
            raise NotReadyError(record)
        data = self.cache.get(StoreKey.parse(record.output_key), lookup=False)
        if data is None:
            raise GoneError(f"the output of {request_id} has expired from the cache")
        return record, data.numpy().tobytes()

    def cancel(self, tenant: str, request_id: str) -> RequestRecord:
        record = self.record(tenant, request_id)
        if not self.records.cancel(tenant, request_id):
            raise NotReadyError(record)
        return self.record(tenant, request_id)

    def preempt(self, tenant: str, request_id: str, mode: PreemptMode) -> RequestRecord:
        """Ask the denoise worker to checkpoint and step aside; 409 unless denoising."""
        record = self.record(tenant, request_id)
        if not self.lifecycle.ask_preempt(tenant, request_id, mode):
            raise NotReadyError(record, "only a DENOISING request can be preempted")
        return self.record(tenant, request_id)

    def resume(self, tenant: str, body: ResumeBody) -> str:
        """Resume in place (no overrides), or branch a new request from a checkpoint."""
        record = self.record(tenant, body.request_id)
        if body.overrides is None:
            if body.from_step is not None:
                raise FieldError("from_step", "applies with overrides only: a plain resume "
                                 "continues from the latest checkpoint")
            try:
                self.lifecycle.resume(record)
            except LifecycleError as exc:
                raise NotReadyError(record, str(exc)) from exc
            return record.spec.request_id
        from_step, key = branch_point(record, body.from_step)
        if not self.cache.exists(StoreKey.parse(key)):
            raise GoneError(f"the checkpoint of {body.request_id} at step {from_step} has "
                            "expired from the cache; resume from another step")
        spec = branched_spec(record.spec, new_request_id(), from_step, body.overrides,
                             self.settings.api)
        return submit(self.redis, spec)

    def readiness(self) -> dict[str, bool]:
        checks: dict[str, bool] = {}
        try:
            checks["redis"] = bool(self.redis.ping())
        except redis.RedisError:
            checks["redis"] = False
        try:
            self.cache.exists(StoreKey("default", KeyKind.SCRATCH, "readyz"))
            checks["store"] = True
        except StoreUnavailableError:
            checks["store"] = False
        for stage in Stage:
            checks[f"{stage.value}_workers"] = (checks["redis"]
                                                and bool(live_consumers(self.redis, stage)))
        return checks

