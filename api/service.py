"""What the API does with a request, apart from HTTP: canonicalize, admit, submit, look up.

It holds the Redis client and the store connection, and talks to workers only through
``workers.queue`` (submit, records, lifecycle, streams).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from uuid import uuid4

import redis
import xxhash

from admission.body import GenerateBody, ResumeBody
from admission.editing import branch_point
from admission.request import RequestAdmission
from api.schemas import ChildState, Readiness, RequestStatus, ReuseStatus, StepCacheStatus
from cachesvc.cache_link import CacheLink
from cachesvc.errors import CacheError, StoreUnavailableError
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import RedisClient
from config.settings import Settings
from keys import GenerationSpec, KeyKind, StoreKey
from keys.names import KEY_VERSION, call_waiters, check_tenant
from supervision.supervisor import ChildStatus, read_published
from uploads.adapters import AdapterInfo, AdapterRegistry
from uploads.images import ImageStore, InputImage
from workers.queue.admission import FieldError, Limits, QueueFullError, publish_limits
from workers.queue.client import HEARTBEAT_WITHIN_S, NotReadyError, QueueClient
from workers.queue.messages import Stage
from workers.queue.schema import Field, KindField, PreemptMode, RequestRecord, State
from workers.queue.served_model import ServedModel

if TYPE_CHECKING:
    from cachesvc.byte_entries import ByteEntries

# Drops an idempotency key only while it still names the request that was refused, so a
# concurrent duplicate that won meanwhile keeps its key.
_FORGET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RecomputingError(RuntimeError):
    """A DONE request's output was lost before its TTL; it is being made again."""


class NoDenoiserError(RuntimeError):
    """Nothing to validate an adapter against yet; retry once a denoise worker runs."""


class GoneError(RuntimeError):
    pass


class ClientGoneError(ConnectionError):
    """The client of a synchronous call went away before its answer was ready."""


class WaitTimeoutError(TimeoutError):
    """A synchronous endpoint waited longer than ``api.sync_timeout_s``."""


def idempotency_key(tenant: str, key: str) -> str:
    return f"{KEY_VERSION}:{check_tenant(tenant)}:idem:{xxhash.xxh3_128_hexdigest(key.encode())}"


def model_of(record: RequestRecord) -> dict[str, str] | None:
    family, _, name = (record.get(Field.MODEL) or "").partition("/")
    return {"family": family, "name": name} if name else None


def status_of(record: RequestRecord) -> RequestStatus:
    spec = record.spec
    return RequestStatus(
        id=spec.request_id, state=record.state.value, step=record.step,
        steps=spec.num_inference_steps, output_format=spec.output_format.value,
        priority=spec.priority.value,
        stage_seconds={s.value: v for s, v in record.stage_seconds().items()},
        cache_hits=record.hits(), resumed_from=record.counter(Field.RESUMED_FROM),
        checkpoints=sorted(record.checkpoints()), preemptions=record.counter(Field.PREEMPTIONS),
        model=model_of(record), recomputed=record.recomputed(), error=record.error,
        rescues=record.counter(Field.RESCUES), late=record.late(), warnings=record.warnings,
        loras=[{"hash": lora.hash, "scale": lora.scale} for lora in spec.loras],
        step_cache=StepCacheStatus(
            policy=spec.step_cache.policy, params=dict(spec.step_cache.params),
            forwards=record.counter(KindField.LOOKUPS.of(KeyKind.STEP)),
            skipped=record.counter(KindField.HITS.of(KeyKind.STEP)))
        if spec.step_cache.on else None,
        reuse=reuse_status(record),
        created_at=record.created_at, updated_at=record.updated_at)


def reuse_headers(record: RequestRecord) -> dict[str, str]:
    """What approximate reuse did, on the result itself: a client that only downloads it
    still learns whether it is the exact output of what it asked for."""
    reuse = reuse_status(record)
    if not reuse.approximate:
        return {"X-Diffcache-Reuse": "exact"}
    return {"X-Diffcache-Reuse": "approximate",
            "X-Diffcache-Reuse-Source": str(reuse.source_request_id),
            "X-Diffcache-Reuse-Step": str(reuse.steps_reused),
            "X-Diffcache-Reuse-Similarity": f"{reuse.similarity:.4f}",
            "X-Diffcache-Effective-Seed": str(reuse.effective_seed)}


def reuse_status(record: RequestRecord) -> ReuseStatus:
    hit = record.approximate
    return ReuseStatus(mode=record.spec.reuse.mode, approximate=hit is not None,
                       source_request_id=hit.source_request_id if hit else None,
                       steps_reused=hit.step if hit else 0,
                       similarity=hit.similarity if hit else None,
                       effective_seed=record.spec.seed)


@dataclass
class Service:
    settings: Settings
    redis: RedisClient
    store: CacheLink  # the store client, connected in the background
    queue: QueueClient = field(init=False)
    adapters: AdapterRegistry = field(init=False)
    images: ImageStore = field(init=False)
    admission: RequestAdmission = field(init=False)
    files: OutputFiles | None = field(init=False)

    def __post_init__(self) -> None:
        self.queue = QueueClient(self.redis, Limits.of(self.settings.api))
        self._limits_published = False
        self.adapters = AdapterRegistry(lambda: self.cache, self.redis,
                                        self.settings.data_dir / "adapters")
        self.images = ImageStore(lambda: self.cache, self.settings.data_dir / "images")
        self.admission = RequestAdmission(self.settings.api, self.queue.admission, self.images,
                                          self.adapters)
        self._forget = self.redis.register_script(_FORGET)
        cache = self.settings.cache
        self.files = (OutputFiles(self.settings.outputs_dir, cache.output_ttl_s)
                      if cache.durable_outputs else None)

    @property
    def cache(self) -> ByteEntries:
        """The store client; StoreUnavailableError (503) until it has connected."""
        return self.store.cache

    def add_adapter(self, tenant: str, name: str, data: bytes) -> AdapterInfo:
        linears = self.queue.view.lora_targets()
        if not linears:
            raise NoDenoiserError("no denoise worker has said which layers it serves yet; "
                                  "retry once one has started")
        return self.adapters.add(tenant, name, data, linears)

    def add_image(self, tenant: str, data: bytes, field: str = "image") -> InputImage:
        image = self.admission.decoded_image(data, field)
        self.images.add(tenant, image)
        return image

    def served(self) -> ServedModel:
        """The model the workers said they serve; NotPublishedError (503) before any has."""
        if not self._limits_published:
            # Read by `diffcache submit`, so it admits under this deployment's limits too;
            # published with the first admission, as Redis may not answer at start.
            publish_limits(self.redis, Limits.of(self.settings.api))
            self._limits_published = True
        return self.queue.served()

    def generate(self, tenant: str, body: GenerateBody, idem: str | None = None,
                 uploads: Sequence[InputImage] = ()) -> str:
        """Admit and submit; with an idempotency key, a repeat returns the first request.
        An image that came with the request (inline, or in ``uploads``) is kept only once
        the request is admitted: a refused request leaves nothing behind."""
        if idem is not None:
            existing = self.redis.get(idempotency_key(tenant, idem))
            if existing is not None:
                return existing.decode()  # type: ignore[union-attr]
        served = self.served()  # read once: the limits and the record name the same model
        admitted = self.admission.admit(tenant, body, served, uploads)
        spec = admitted.spec
        for upload in admitted.uploads:
            self.images.add(tenant, upload)
        # First writer wins; a concurrent duplicate gets the winner's id.
        if idem is not None and not self.redis.set(idempotency_key(tenant, idem),
                                                   spec.request_id, nx=True,
                                                   ex=self.settings.retention.idempotency_s):
            winner = self.redis.get(idempotency_key(tenant, idem))
            return winner.decode()  # type: ignore[union-attr]
        try:
            return self.submit(spec, served)
        except QueueFullError:
            if idem is not None:  # a retry after the 429 must be admitted afresh
                self._forget(keys=[idempotency_key(tenant, idem)], args=[spec.request_id])
            raise

    def remember_call(self, tenant: str, call: str, request_id: str) -> None:
        """Note which request a synchronous call made, for as long as a retry of it may come
        (twice the call's own wait)."""
        self.redis.set(idempotency_key(tenant, call), request_id,
                       ex=int(2 * self.settings.api.sync_timeout_s) + 1)

    def attend_call(self, tenant: str, call: str) -> None:
        """Count one more caller waiting on the call's request, before it joins or makes one:
        an abandoned caller cancels the request only when it was the last."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(call_waiters(tenant, call))
        pipe.expire(call_waiters(tenant, call), int(2 * self.settings.api.sync_timeout_s) + 1)
        pipe.execute()

    def leave_call(self, tenant: str, call: str) -> int:
        """Count a caller out; how many still wait."""
        return int(self.redis.decr(call_waiters(tenant, call)))

    def join_call(self, tenant: str, call: str) -> str | None:
        """The request an earlier attempt of this call made, resumed if its abandonment
        cancelled it; None when there is none to join (expired, or it failed)."""
        found = self.redis.get(idempotency_key(tenant, call))
        if found is None:
            return None
        record = self.queue.records.get(tenant, found.decode())  # type: ignore[union-attr]
        if record is None or record.state is State.FAILED:
            return None
        if record.state is State.CANCELLED:
            self.resume(tenant, ResumeBody(request_id=record.spec.request_id))
        return record.spec.request_id

    def submit(self, spec: GenerationSpec, served: ServedModel) -> str:
        return self.queue.submit(spec, served)

    def record(self, tenant: str, request_id: str) -> RequestRecord:
        return self.queue.get(tenant, request_id)

    def result(self, tenant: str, request_id: str) -> tuple[RequestRecord, bytes]:
        record = self.record(tenant, request_id)
        if record.state is not State.DONE or record.output_key is None:
            raise NotReadyError(record)
        key = StoreKey.parse(record.output_key)
        outage: StoreUnavailableError | None = None
        try:
            data = self.cache.read(key)
        except StoreUnavailableError as exc:
            data, outage = None, exc  # the output file may still be there
        if data is not None:
            return record, data
        on_disk = self.files.read(key) if self.files is not None else None
        if on_disk is not None:
            return record, on_disk
        if outage is not None:
            raise outage  # whether the store still has it is unknown until it answers
        if time.time() > record.updated_at + self.settings.cache.output_ttl_s:
            raise GoneError(f"the output of {request_id} has expired (cache.output_ttl_s)")
        # Lost before its time, with the store or its file: the request is seeded, so running
        # it again gives the same output.
        self.uploads_stored(record.spec)
        self.queue.recompute_output(record)
        raise RecomputingError(f"the output of {request_id} was lost from the cache and is "
                               "being made again from the request; retry shortly")

    def cancel(self, tenant: str, request_id: str) -> RequestRecord:
        return self.queue.cancel(tenant, request_id)

    def preempt(self, tenant: str, request_id: str, mode: PreemptMode) -> RequestRecord:
        """Ask the denoise worker to checkpoint and step aside; 409 unless denoising."""
        return self.queue.preempt(tenant, request_id, mode)

    def resume(self, tenant: str, body: ResumeBody) -> str:
        """Resume in place (no overrides), or branch a new request from a checkpoint."""
        record = self.record(tenant, body.request_id)
        if body.overrides is None:
            if body.from_step is not None:
                raise FieldError("from_step", "applies with overrides only: a plain resume "
                                 "continues from the latest checkpoint")
            self.uploads_stored(record.spec)
            return self.queue.resume(record)
        from_step, key = branch_point(record, body.from_step)
        if not self.cache.exists(StoreKey.parse(key)):
            raise GoneError(f"the checkpoint of {body.request_id} at step {from_step} has "
                            "expired from the cache; resume from another step")
        served = self.served()
        spec = self.admission.branch(record.spec, from_step, body.overrides, served)
        self.uploads_stored(spec)
        return self.submit(spec, served)

    def uploads_stored(self, spec: GenerationSpec) -> None:
        """Put what a request reads from uploads (its input image, its adapters) back in the
        store from their files if the store lost them, before it runs again: a worker can
        recompute anything but an upload."""
        if spec.image is not None:
            self.images.ensure_stored(spec.tenant, spec.image.hash)
            if spec.image.mask is not None:
                self.images.ensure_stored(spec.tenant, spec.image.mask, "mask")
        for lora in spec.loras:
            self.adapters.ensure_stored(spec.tenant, lora.hash)

    def readiness(self) -> Readiness:
        checks: dict[str, bool] = {}
        children: list[ChildStatus] = []
        try:
            checks["redis"] = bool(self.redis.ping())
            children = read_published(self.redis)
        except redis.RedisError:
            checks["redis"] = False
        checks["store"] = self._store_round_trip()
        live = self.queue.stages_live() if checks["redis"] else {}
        for stage in Stage:
            checks[f"{stage.value}_workers"] = live.get(stage, False)
        looping = any(c.crash_looping for c in children)
        why = {"redis": "Redis does not answer",
               "store": self.store.status if not self.store.connected
               else "a put and get through a storage node failed",
               **{f"{s.value}_workers": f"no {s.value} worker has beaten its heartbeat within "
                  f"{HEARTBEAT_WITHIN_S:.0f} s" for s in Stage}}
        return Readiness(
            ready=all(checks.values()) and not looping, checks=checks,
            not_ready={name: why[name] for name, ok in checks.items() if not ok},
            children=[ChildState(name=c.name, role=c.role, pid=c.pid, alive=c.alive,
                                 restarts=c.restarts, last_exit=c.describe_exit(),
                                 last_error=c.last_error, crash_looping=c.crash_looping)
                      for c in children])

    def _store_round_trip(self) -> bool:
        """A real put and get through a storage node: a master that answers while every
        storage node is gone is not a working store."""
        if not self.store.connected:
            return False
        key = StoreKey(self.settings.default_tenant, KeyKind.SCRATCH, f"readyz-{uuid4().hex}")
        probe = bytes(range(16))
        try:
            self.cache.write(key, probe)
            back = self.cache.read(key)
            self.cache.remove(key)
        except CacheError:
            return False
        return back == probe
