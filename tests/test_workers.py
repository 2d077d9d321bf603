"""The disaggregated pipeline, run by real worker processes over the real stack, against the
monolithic diffusers ``WanPipeline`` on the same saved model: outputs are bit-identical."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.counters import read_totals
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import KeyKind, StoreKey
from keys.names import dead_letter_stream, stage_stream, value_keys
from supervision.processes import ChildProcess
from tests.workers_harness import (
    make_spec,
    read_frames,
    reference,
    run_request,
    start_worker,
    stop_owner_when,
    wait_done,
)
from workers.queue.messages import Job, Stage
from workers.queue.schema import KindField, State
from workers.queue.submit import submit

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("changes", [
    {},
    {"guidance_scale": 1.0},
    {"seed": 1234, "num_inference_steps": 6, "negative_prompt": ""},
    {"width": 48, "height": 32, "num_frames": 9, "prompt": "Two dogs, running on a BEACH!"},
    {"num_frames": 1, "guidance_scale": 3.5},
], ids=["cfg", "no-cfg", "empty-negative", "wide-9-frames", "single-frame"])
def test_outputs_are_bit_identical_to_the_diffusers_pipeline(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object,
        changes: dict[str, object]) -> None:
    spec = make_spec(**changes)
    frames = run_request(worker_settings, client, spec)
    expected = reference(pipe, spec)
    assert frames.shape == expected.shape == (spec.num_frames, spec.height, spec.width, 3)
    assert np.array_equal(frames, expected)


def test_a_repeated_prompt_is_encoded_once(worker_settings: Settings, client: redis.Redis,
                                           pool: object) -> None:
    first = make_spec(prompt="a lighthouse at dawn", negative_prompt="dark", seed=1)
    second = make_spec(prompt="a lighthouse at dawn", negative_prompt="dark", seed=2)
    run_request(worker_settings, client, first)
    run_request(worker_settings, client, second)
    records = [wait_done(client, s) for s in (first, second)]
    assert records[0].hits()["embed"] == 0
    assert records[1].hits()["embed"] == 2  # prompt and negative prompt both hit
    # Each held its embeddings from eviction on its way through the stages, and lets go once
    # its output is published (just after DONE shows).

    def released() -> bool:
        holds = client.zrange(value_keys(first.tenant)[4], 0, -1)
        return not [h for h in holds
                    if h.decode().split("|")[0] in (first.request_id, second.request_id)]

    wait_until(released, timeout_s=30, interval_s=0.05, what="the requests' holds released")


def test_two_workers_of_one_stage_share_the_load(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        tmp_path: Path) -> None:
    pool[Stage.DENOISE].append(start_worker(worker_settings, Stage.DENOISE, tmp_path, client,
                                            "denoise-1"))
    specs = [make_spec(seed=100 + i, num_inference_steps=8) for i in range(6)]
    for spec in specs:
        submit(client, spec)
    records = [wait_done(client, spec) for spec in specs]
    assert all(r.state is State.DONE for r in records)
    assert len({r.fields["worker:denoise"] for r in records}) >= 2  # earlier tests add more


def decode_entries_for(client: redis.Redis, request_id: str) -> int:
    entries = client.xrange(stage_stream(Stage.DECODE.value, "interactive"))
    return sum(Job.from_json(fields[b"job"]).request_id == request_id for _, fields in entries)


@pytest.mark.parametrize("stage", [Stage.DENOISE, Stage.DECODE])
def test_kill_9_mid_request_completes_once_with_the_same_output(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path, stage: Stage) -> None:
    # Long enough in the stage under test that the kill lands mid-job.
    spec = make_spec(seed=77, num_inference_steps=40 if stage is Stage.DENOISE else 4,
                     num_frames=33 if stage is Stage.DECODE else 5, width=64, height=64)
    submit(client, spec)

    def mid_job(fields: dict[str, str]) -> bool:
        """Denoise has reported a step; decode (which reports no steps) has claimed the job."""
        if stage is Stage.DENOISE:
            return int(fields.get("step", 0)) >= 1
        return fields.get("state") == State.DECODING.value

    # Stopped mid-job, as its own record says, then killed there.
    victim, _ = stop_owner_when(client, spec, stage, pool[stage], mid_job)
    victim.kill()
    pool[stage].remove(victim)
    pool[stage].append(start_worker(worker_settings, stage, tmp_path, client, "replacement"))
    record = wait_done(client, spec)
    assert record.state is State.DONE
    assert int(record.fields[f"attempt:{stage.value}"]) == 2
    assert decode_entries_for(client, spec.request_id) == 1  # published once
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def test_a_poison_request_is_dead_lettered_with_its_reason(
        client: redis.Redis, pool: object) -> None:
    # PNG holds one frame: decode fails on every delivery of this five-frame request.
    spec = make_spec(output_format="png", num_frames=5)
    submit(client, spec)
    record = wait_done(client, spec, timeout_s=180)
    assert record.state is State.FAILED
    assert record.error is not None and "decode failed 3 deliveries" in record.error
    dead = client.xrange(dead_letter_stream())
    assert any(Job.from_json(f[b"job"]).request_id == spec.request_id for _, f in dead)


def test_submitting_a_request_id_twice_queues_it_once(client: redis.Redis) -> None:
    spec = make_spec()
    stream = stage_stream(Stage.ENCODE.value, "interactive")
    before = client.xlen(stream)
    assert submit(client, spec) == submit(client, spec) == spec.request_id
    assert client.xlen(stream) == before + 1


def test_an_identical_seeded_request_is_answered_from_the_output_cache(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    first = make_spec(tenant="repeats", prompt="a green train at night", seed=4242)
    again = make_spec(tenant="repeats", prompt="a green train at night", seed=4242)
    frames = run_request(worker_settings, client, first)
    repeat = run_request(worker_settings, client, again)
    record = wait_done(client, again)
    assert record.hits()["output"] == 1
    assert "seconds:denoise" not in record.fields  # no denoising at all
    # The hit counts the first request's denoise and decode seconds as saved.
    spent = sum(wait_done(client, first).stage_seconds()[s] for s in ("denoise", "decode"))
    wait_until(lambda: read_totals(client, "repeats").get("output.compute_seconds_saved"),
               timeout_s=10, interval_s=0.1, what="the saving counted")
    assert 0 < read_totals(client, "repeats")["output.compute_seconds_saved"] <= spent
    assert np.array_equal(frames, repeat)
    changed = make_spec(tenant="repeats", prompt="a green train at night", seed=4243)
    run_request(worker_settings, client, changed)
    assert "seconds:denoise" in wait_done(client, changed).fields  # another seed: computed


def test_an_output_evicted_from_the_store_but_on_disk_still_answers_a_repeat(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    first = make_spec(tenant="repeats", prompt="a red kite over a field", seed=5151)
    frames = run_request(worker_settings, client, first)
    output = StoreKey.parse(wait_done(client, first).output_key or "")
    cache = open_cache(worker_settings)
    try:
        assert cache.remove(output)  # as eviction under memory pressure would
        again = make_spec(tenant="repeats", prompt="a red kite over a field", seed=5151)
        repeat = run_request(worker_settings, client, again)
        record = wait_done(client, again)
        # Present on disk is present: the repeat ends at encode, and the output is back in the
        # store for the next one. Two lookups: the store's miss, then the restored entry.
        assert "seconds:denoise" not in record.fields
        assert record.hits()["output"] == 1
        assert record.counter(KindField.LOOKUPS.of(KeyKind.OUTPUT)) == 2
        assert cache.exists(output)
    finally:
        cache.close()
    assert np.array_equal(frames, repeat)
