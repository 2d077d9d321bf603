"""Worker processes for tests, started as `diffcache worker <stage>` against the session stack,
and helpers to submit requests and read their outputs."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from cachesvc.connect import open_cache
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import open_redis
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import WaitTimeout, wait_until
from config.settings import (
    ApiSettings,
    ModelSettings,
    Settings,
    WorkerSettings,
    child_environ,
    load_settings,
)
from keys import GenerationSpec, Priority, StepCache, StoreKey
from keys.names import consumer_group, request_record, stage_stream
from supervision.processes import ChildProcess, free_port
from supervision.stack import EmbeddedStack
from workers.launch import wait_joined, worker_argv
from workers.queue.messages import Job, Stage
from workers.queue.records import Records
from workers.queue.runtime import consumer_name
from workers.queue.schema import RequestRecord, State
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy


def publish_as_workers(client: redis.Redis, settings: Settings) -> None:
    """Publish the served model of ``settings`` (its folder built) exactly as a worker does at
    start: for an API tested without worker processes."""
    from workers.families import resolve
    from workers.main import publish_model

    publish_model(client, settings, resolve(settings.model.family, settings.model_dir,
                                            settings.model.preset))


def start_worker(settings: Settings, stage: Stage, logs: Path, client: redis.Redis,
                 name: str) -> ChildProcess:
    child = ChildProcess(name, worker_argv(stage), logs / f"{name}.log",
                         child_environ(settings))
    child.start()
    wait_joined(child, client, stage)
    return child


def serving(settings: Settings, model_dir: Path, workers: dict[str, Any] | None = None,
            **model: Any) -> Settings:
    """``settings`` with workers serving the test preset of the model in ``model_dir`` (with
    ``model``'s other settings), and a quick lease takeover (and ``workers``' settings)."""
    return settings.model_copy(update={
        "model": ModelSettings(dir=model_dir, preset="test", **model),
        "workers": WorkerSettings(idle_timeout_s=3.0, block_ms=200, **(workers or {}))})


@contextmanager
def embedded_serving(data_dir: Path, model_dir: Path, workers: dict[str, Any] | None = None,
                     **model: Any) -> Iterator[Settings]:
    """An embedded stack kept in ``data_dir`` (a 64 MiB store segment), with settings for
    workers serving the model in ``model_dir`` (``serving``)."""
    settings = load_settings(data_dir=str(data_dir), store={"segment_mib": 64})
    stack = EmbeddedStack(settings)
    with stack as addresses:
        yield serving(stack.resolved(addresses), model_dir, workers, **model)


@dataclass(frozen=True, slots=True)
class ModelService:
    """A stack of a test module's own, with one worker per stage serving its model."""

    settings: Settings
    client: redis.Redis
    pool: dict[Stage, list[ChildProcess]]


@contextmanager
def model_service(data_dir: Path, model_dir: Path, name: str,
                  workers: dict[str, Any] | None = None, **model: Any) -> Iterator[ModelService]:
    """``embedded_serving`` in ``data_dir`` with ``worker_pool`` (workers named for
    ``name``, their logs beside the stack) for the block."""
    with embedded_serving(data_dir / "stack", model_dir, workers, **model) as settings:
        client = open_redis(settings)
        with worker_pool(settings, client, data_dir, name) as pool:
            yield ModelService(settings, client, pool)


@contextmanager
def worker_pool(settings: Settings, client: redis.Redis, logs: Path,
                suffix: str) -> Iterator[dict[Stage, list[ChildProcess]]]:
    """One worker per stage (named ``<stage>-<suffix>``) for the block; tests may add and kill
    more, and every one left in the lists is stopped at the end."""
    workers = {stage: [start_worker(settings, stage, logs, client, f"{stage}-{suffix}")]
               for stage in Stage}
    try:
        yield workers
    finally:
        for children in workers.values():
            for child in children:
                child.stop()


def worker_named(children: list[ChildProcess], name: str | bytes) -> ChildProcess:
    """The live worker whose consumer name (as a record's ``worker:<stage>`` holds it) is
    ``name``."""
    text = name.decode() if isinstance(name, bytes) else name
    return next(c for c in children if c.alive() and consumer_name(c.pid) == text)


def lose_output(settings: Settings, cache: TensorCache, record: RequestRecord) -> bool:
    """Lose a request's output wherever it is kept, the store and the disk, so that a repeat
    computes it again; whether the store had it."""
    assert record.output_key is not None
    key = StoreKey.parse(record.output_key)
    OutputFiles(settings.outputs_dir, settings.cache.output_ttl_s).path(key).unlink(
        missing_ok=True)
    return cache.remove(key)


def rewind(settings: Settings, cache: TensorCache, record: RequestRecord, step: int) -> None:
    """Lose a request's checkpoints after ``step`` and its output, so that a repeat of it
    resumes at ``step``."""
    for at, key in record.checkpoints().items():
        if at > step:
            cache.remove(StoreKey.parse(key))
    lose_output(settings, cache, record)


def make_spec(tenant: str = "acme", **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(request_id=new_request_id(), tenant=tenant,
                                     prompt="a red fox in the snow", negative_prompt="blurry",
                                     width=32, height=32, num_frames=5, num_inference_steps=4,
                                     guidance_scale=5.0, seed=11, output_format="npy")
    fields.update(changes)
    return GenerationSpec.create(**fields)  # type: ignore[arg-type]


def record_fields(client: redis.Redis, spec: GenerationSpec) -> dict[str, str]:
    """The request's record as it stands, decoded; empty if there is none."""
    raw: dict[bytes, bytes] = client.hgetall(  # type: ignore[assignment]
        request_record(spec.tenant, spec.request_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


def wait_done(client: redis.Redis, spec: GenerationSpec, timeout_s: float = 120) -> RequestRecord:
    records = Records(client)

    def finished() -> RequestRecord | None:
        record = records.get(spec.tenant, spec.request_id)
        return record if record is not None and record.state.terminal else None

    try:
        return wait_until(finished, timeout_s=timeout_s, interval_s=0.05,
                          what=f"request {spec.request_id} finished")
    except WaitTimeout as exc:
        exc.add_note(f"its record: {records.get(spec.tenant, spec.request_id)}")
        raise


def answered_record(client: redis.Redis, settings: Settings, url: str | None) -> RequestRecord:
    """The record of the request behind an OpenAI route's answer, by its output's ``url``
    (``/v1/outputs/<request id>/<file>``), under the deployment's default tenant."""
    assert url is not None, "the answer gave no url"
    record = Records(client).get(settings.default_tenant, url.rsplit("/", 2)[-2])
    assert record is not None, f"no record behind {url}"
    return record


def wait_for(client: redis.Redis, spec: GenerationSpec, state: State, min_step: int = 0,
             timeout_s: float = 120) -> dict[str, str]:
    """The record once it is in ``state`` with at least ``min_step`` steps reported."""

    def reached() -> dict[str, str] | None:
        fields = record_fields(client, spec)
        if fields.get("state") == state.value and int(fields.get("step", 0)) >= min_step:
            return fields
        assert fields.get("state") not in ("DONE", "FAILED") or state is State.DONE, fields
        return None

    return wait_until(reached, timeout_s=timeout_s, interval_s=0.005,
                      what=f"{spec.request_id} {state} at step {min_step}")


def in_hand(client: redis.Redis, stage: Stage, request_id: str) -> bool:
    """Whether a worker of ``stage`` holds a delivery of ``request_id`` that it has not yet
    acknowledged: once it is False, that worker is done with the job, whatever it did."""
    group = consumer_group(stage.value)
    for priority in Priority:
        stream = stage_stream(stage.value, priority.value)
        try:
            pending: list[dict[str, Any]] = client.xpending_range(stream, group, min="-",
                                                                  max="+", count=10_000)
        except redis.ResponseError:  # no such stream or group yet
            continue
        for p in pending:
            entries: list[Any] = client.xrange(stream, p["message_id"], p["message_id"])
            if entries and Job.from_json(entries[0][1][b"job"]).request_id == request_id:
                return True
    return False


def stop_owner_when(client: redis.Redis, spec: GenerationSpec, stage: Stage,
                    children: list[ChildProcess], ready: Callable[[dict[str, str]], bool],
                    timeout_s: float = 120) -> tuple[ChildProcess, dict[str, str]]:
    """SIGSTOP the worker of ``children`` that runs ``spec``'s ``stage`` once the progress it
    reports on the record satisfies ``ready``; that worker, and the record as it left it.

    The record is read again once the worker is stopped (and the worker let go again if it has
    moved past ``ready`` meanwhile), so what the caller sees is exactly where the worker stands,
    however fast it runs. The caller kills it, or SIGCONTs it. If the stage finishes before a
    poll sees it ``ready``, the job is too short for this machine: that fails here, not as a
    confusing assertion later."""
    done = f"done:{stage.value}"

    def stopped() -> tuple[ChildProcess, dict[str, str]] | None:
        fields = record_fields(client, spec)
        assert done not in fields and fields.get("state") not in ("DONE", "FAILED"), \
            f"{spec.request_id} finished {stage} before it could be stopped: {fields}"
        if not ready(fields):
            return None
        owner = worker_named(children, fields[f"worker:{stage.value}"])
        assert owner.pid is not None
        os.kill(owner.pid, signal.SIGSTOP)
        fields = record_fields(client, spec)
        if done not in fields and ready(fields):
            return owner, fields
        os.kill(owner.pid, signal.SIGCONT)
        return None

    return wait_until(stopped, timeout_s=timeout_s, interval_s=0.002,
                      what=f"{spec.request_id}'s {stage} worker stopped where the test wants it")


def run_request(settings: Settings, client: redis.Redis, spec: GenerationSpec) -> np.ndarray:
    """Submit ``spec``, wait for it, and return its frames (F, H, W, 3) uint8."""
    submit(client, spec)
    record = wait_done(client, spec)
    assert record.state is State.DONE, record
    return read_frames(settings, record)


def read_frames(settings: Settings, record: RequestRecord) -> np.ndarray:
    assert record.output_key is not None
    cache = open_cache(settings)
    try:
        data = cache.get(StoreKey.parse(record.output_key), lookup=False)
    finally:
        cache.close()
    assert data is not None
    return decode_npy(data.numpy().tobytes())


def step_cache_is_the_pipelines(service: ModelService,
                                pipeline: Callable[[GenerationSpec], np.ndarray],
                                spec: GenerationSpec) -> None:
    """``spec``, under a step cache, through the workers gives ``pipeline``'s output under the
    same cache, which is not its output without one; and the cache stood in for work."""
    want = pipeline(spec)
    assert not np.array_equal(want, pipeline(dataclasses.replace(spec, step_cache=StepCache())))
    assert np.array_equal(run_request(service.settings, service.client, spec), want)
    assert wait_done(service.client, spec).counter("hits:step") > 0


def reference(pipe: object, spec: GenerationSpec) -> np.ndarray:
    """The monolithic pipeline's frames for ``spec`` (a family's ``reference``), as uint8,
    run with one intra-op thread as the workers run: the condition for bit-identity."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pipe(spec)  # type: ignore[operator,no-any-return]
    finally:
        torch.set_num_threads(threads)


@contextmanager
def serve_api(settings: Settings, api: ApiSettings) -> Iterator[str]:
    """The API on a free loopback port, in a thread of this process; yields its URL."""
    import uvicorn

    from api.app import create_app

    port = free_port("127.0.0.1")
    app = create_app(settings.model_copy(update={"api": api.model_copy(update={"port": port})}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.started, timeout_s=30, interval_s=0.05,
               what=f"the API serving at {url}")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def paused(children: list[ChildProcess]) -> Iterator[None]:
    """Every live worker of a stage held with SIGSTOP for the block: its stream waits."""
    with signalled(children, signal.SIGSTOP, signal.SIGCONT):
        yield


@contextmanager
def running(children: list[ChildProcess]) -> Iterator[None]:
    """Workers held by ``paused`` let go for the block."""
    with signalled(children, signal.SIGCONT, signal.SIGSTOP):
        yield


@contextmanager
def signalled(children: list[ChildProcess], first: signal.Signals,
              then: signal.Signals) -> Iterator[None]:
    held = [c.pid for c in children if c.alive() and c.pid is not None]
    for pid in held:
        os.kill(pid, first)
    try:
        yield
    finally:
        for pid in held:
            os.kill(pid, then)


def version_0(spec: GenerationSpec) -> dict[str, object]:
    """The layout records had before payloads carried an envelope, as that release wrote it."""
    return {
        "request_id": spec.request_id, "tenant": spec.tenant,
        "schedule": [[s.prompt, s.negative_prompt, s.until_step, s.guidance_scale]
                     for s in spec.schedule],
        "width": spec.width, "height": spec.height, "num_frames": spec.num_frames,
        "num_inference_steps": spec.num_inference_steps,
        "guidance_scale": spec.guidance_scale, "seed": spec.seed,
        "output_format": spec.output_format.value, "priority": spec.priority.value,
        "cfg_cache": [spec.cfg_cache.mode.value, spec.cfg_cache.interval],
        "loras": [[lora.hash, lora.scale] for lora in spec.loras],
        "step_cache": [spec.step_cache.policy.value, dict(spec.step_cache.params)],
        "reuse": [spec.reuse.mode.value, spec.reuse.min_similarity, spec.reuse.max_skip],
    }
