"""Worker processes for tests, started as `diffcache worker <stage>` against the session stack,
and helpers to submit requests and read their outputs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis
import torch

from cachesvc.connect import open_cache
from cachesvc.processes import ChildProcess, free_port
from cachesvc.settings import ApiSettings, Settings, child_environ
from keys import GenerationSpec, StoreKey
from workers.launch import wait_joined, worker_argv
from workers.media import decode_npy
from workers.messages import Stage, State
from workers.records import Records, RequestRecord
from workers.runtime import consumer_name
from workers.submit import new_request_id, submit


def start_worker(settings: Settings, stage: Stage, logs: Path, client: redis.Redis,
                 name: str) -> ChildProcess:
    child = ChildProcess(name, worker_argv(stage), logs / f"{name}.log",
                         child_environ(settings))
    child.start()
    wait_joined(child, client, stage)
    return child


def worker_named(children: list[ChildProcess], name: str | bytes) -> ChildProcess:
    """The live worker whose consumer name (as a record's ``worker:<stage>`` holds it) is
    ``name``."""
    text = name.decode() if isinstance(name, bytes) else name
    return next(c for c in children if c.alive() and consumer_name(c.pid) == text)


def make_spec(tenant: str = "acme", **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(request_id=new_request_id(), tenant=tenant,
                                     prompt="a red fox in the snow", negative_prompt="blurry",
                                     width=32, height=32, num_frames=5, num_inference_steps=4,
                                     guidance_scale=5.0, seed=11, output_format="npy")
    fields.update(changes)
    return GenerationSpec.create(**fields)  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 120) -> None:
    """Poll ``predicate`` until it is true; TimeoutError naming ``what`` after ``timeout_s``.
    Every poll in the tests has a deadline, so a regression fails instead of hanging."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.01)


def wait_done(client: redis.Redis, spec: GenerationSpec, timeout_s: float = 120) -> RequestRecord:
    records = Records(client)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = records.get(spec.tenant, spec.request_id)
        if record is not None and record.state.terminal:
            return record
        time.sleep(0.05)
    last = records.get(spec.tenant, spec.request_id)
    raise TimeoutError(f"request {spec.request_id} not finished: {last}")


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
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
