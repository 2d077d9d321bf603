"""A cache is only a cache: a stage input lost from the store sends the request back to the
stage that produces it (a recompute, not a failed delivery), and the output is still
bit-identical to the monolithic pipeline (one thread per op, CPU, float32)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.output_files import OutputFiles
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import GenerationSpec, StepCache, StoreKey
from keys.names import stage_stream
from supervision.processes import ChildProcess
from tests.test_preemption import LONG
from tests.workers_harness import (
    make_spec,
    paused,
    read_frames,
    reference,
    running,
    serve_api,
    wait_done,
    wait_for,
)
from workers.queue.messages import LATENTS, Job, Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.submit import submit
from workers.stages.media import decode_npy

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


def test_denoise_without_its_embeddings_sends_the_request_back_to_encode(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object) -> None:
    spec = make_spec(seed=1301, **LONG)
    with paused(pool[Stage.DENOISE]):
        submit(client, spec)
        wait_for(client, spec, State.ENCODED)
        lose(worker_settings, embeddings_of(client, spec))  # the storage node lost them
    record = wait_done(client, spec)
    assert record.state is State.DONE, record.error
    assert record.counter("recomputed:embed") == 1
    assert record.error is None  # the miss was a recompute, not a failed attempt
    assert record.fields["attempt:denoise"] == "1"
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def lose(settings: Settings, keys: list[StoreKey]) -> None:
    """Remove entries even while a reader's lease holds them, as a storage node's loss does
    (remove_all would skip the embeddings that other tests just read)."""
    cache = open_cache(settings)
    try:
        for key in keys:
            cache.remove(key)
    finally:
        cache.close()


def entry_for(client: redis.Redis, stage: Stage, request_id: str) -> Job:
    """The newest job of ``stage`` for the request."""
    found = [job for _, fields in client.xrange(stage_stream(stage.value, "interactive"))
             if (job := Job.from_json(fields[b"job"])).request_id == request_id]
    assert found, f"no {stage} job for {request_id}"
    return found[-1]


def embeddings_of(client: redis.Redis, spec: GenerationSpec) -> list[StoreKey]:
    return [StoreKey.parse(r.key) for r in entry_for(client, Stage.DENOISE, spec.request_id).refs]


@pytest.mark.parametrize("step_cache", [StepCache(), StepCache.create("first_block",
                                                                      threshold=0.3)],
                         ids=lambda c: c.policy.value)
def test_decode_without_latents_goes_back_to_denoise_which_resumes_at_the_end(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, step_cache: StepCache) -> None:
    spec = make_spec(seed=1302, step_cache=step_cache, **LONG)
    with paused(pool[Stage.DECODE]):
        submit(client, spec)
        wait_for(client, spec, State.DENOISED)
        job = entry_for(client, Stage.DECODE, spec.request_id)
        lose(worker_settings, [StoreKey.parse(job.ref(LATENTS).key)])
    record = wait_done(client, spec)
    assert record.state is State.DONE, record.error
    assert record.counter("recomputed:latents") == 1
    # Denoise found the checkpoint it wrote after its last step: nothing was denoised again.
    assert record.counter("resumed_from") == spec.num_inference_steps
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def test_a_store_that_keeps_losing_entries_fails_the_request_with_that_reason(
        worker_settings: Settings, client: redis.Redis,
        pool: dict[Stage, list[ChildProcess]]) -> None:
    spec = make_spec(seed=1303)
    bound = worker_settings.workers.max_recomputes
    with paused(pool[Stage.DENOISE]):
        submit(client, spec)
        wait_for(client, spec, State.ENCODED)
        embeddings = embeddings_of(client, spec)
        for _ in range(bound + 1):
            lose(worker_settings, embeddings)  # lost again, every time it comes back
            with paused(pool[Stage.ENCODE]), running(pool[Stage.DENOISE]):
                wait_until_in(client, spec, {State.QUEUED, State.FAILED})  # sent back
            if state_of(client, spec) is not State.FAILED:
                wait_for(client, spec, State.ENCODED)  # encoded again
    record = wait_done(client, spec)
    assert record.state is State.FAILED
    assert record.counter("recomputes") == bound + 1
    assert record.error is not None and "workers.max_recomputes" in record.error


def wait_until_in(client: redis.Redis, spec: GenerationSpec, states: set[State]) -> None:
    wait_until(lambda: state_of(client, spec) in states, timeout_s=60,
               what=f"{spec.request_id} in one of {sorted(states)}")


def state_of(client: redis.Redis, spec: GenerationSpec) -> State:
    record = Records(client).get(spec.tenant, spec.request_id)
    assert record is not None
    return record.state


def test_a_done_requests_lost_output_is_made_again_not_refused(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object) -> None:
    spec = make_spec(tenant="default", seed=1304)
    submit(client, spec)
    done = wait_done(client, spec)
    assert done.output_key is not None
    key = StoreKey.parse(done.output_key)
    cache = open_cache(worker_settings)
    try:
        assert cache.remove(key)  # lost from the store ...
    finally:
        cache.close()
    files = OutputFiles(worker_settings.outputs_dir, worker_settings.cache.output_ttl_s)
    assert files.read(key) is not None
    with serve_api(worker_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        path = f"/v1/requests/{spec.request_id}/result"
        served = http.get(path)  # ... and still served, from its file
        assert served.status_code == 200
        assert np.array_equal(decode_npy(served.content), reference(pipe, spec))
        files.path(key).unlink()  # ... then lost from disk too
        again = http.get(path)
        assert again.status_code == 503 and again.headers["retry-after"]
        assert "being made again" in again.json()["error"]
        record = wait_done(client, spec)
        assert record.state is State.DONE and record.recomputed() == {"output": 1}
        assert np.array_equal(decode_npy(http.get(path).content), reference(pipe, spec))
