"""Priorities, preemption, resume, fencing and flow control over the real stack and workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.processes import ChildProcess
from cachesvc.settings import Settings
from cachesvc.stack import EmbeddedStack
from keys import GenerationSpec, latents_key
from keys.names import request_record, stage_stream
from tests.workers_harness import (
    make_spec,
    read_frames,
    reference,
    start_worker,
    wait_done,
    worker_named,
)
from workers.credits import Credits
from workers.lifecycle import Lifecycle
from workers.messages import Job, Stage, State
from workers.records import PreemptMode, Records
from workers.submit import submit

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

LONG = {"num_inference_steps": 40, "width": 64, "height": 64}


def wait_for(client: redis.Redis, spec: GenerationSpec, state: State, min_step: int = 0,
             timeout_s: float = 120) -> dict[str, str]:
    key = request_record(spec.tenant, spec.request_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        if fields.get("state") == state.value and int(fields.get("step", 0)) >= min_step:
            return fields
        assert fields.get("state") not in ("DONE", "FAILED") or state is State.DONE, fields
        time.sleep(0.005)
    raise TimeoutError(f"{spec.request_id} never reached {state} at step {min_step}")


def denoising(client: redis.Redis, pool: dict[Stage, list[ChildProcess]], seed: int,
              min_step: int) -> tuple[GenerationSpec, dict[str, str], ChildProcess]:
    """A long request, once a worker is ``min_step`` steps into it: its record and worker."""
    spec = make_spec(seed=seed, **LONG)
    submit(client, spec)
    running = wait_for(client, spec, State.DENOISING, min_step=min_step)
    return spec, running, worker_named(pool[Stage.DENOISE], running["worker:denoise"])


def decode_entries_for(client: redis.Redis, spec: GenerationSpec) -> int:
    entries = client.xrange(stage_stream(Stage.DECODE.value, spec.priority.value))
    return sum(Job.from_json(f[b"job"]).request_id == spec.request_id for _, f in entries)


def test_denoise_waits_for_a_decode_credit(worker_settings: Settings, client: redis.Redis,
                                          pool: object) -> None:
    credits = Credits(client, worker_settings.workers.decode_credits)
    holders = [f"holder{n}" for n in range(credits.limit)]
    for holder in holders:  # every credit taken by a trajectory still denoising
        client.hset(request_record("acme", holder), "state", "DENOISING")
        assert credits.acquire("acme", holder, 0)
    spec = make_spec(seed=950)
    submit(client, spec)
    wait_for(client, spec, State.DENOISING)
    deadline = time.monotonic() + 30
    while client.hget(request_record(spec.tenant, spec.request_id), "waiting") != \
            b"decode credit":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.5)  # it keeps waiting: no step runs without a credit
    held = Records(client).get(spec.tenant, spec.request_id)
    assert held is not None and held.state is State.DENOISING and held.step == 0
    client.hset(request_record("acme", holders[0]), "state", "DONE")  # one decode finished
    assert wait_done(client, spec).state is State.DONE
    for holder in holders[1:]:
        credits.release("acme", holder)


def test_waiting_interactive_work_preempts_one_batch_job(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object) -> None:
    busy = [c for c in pool[Stage.DENOISE] if c.alive()]
    batch = [make_spec(seed=500 + n, priority="batch", **LONG) for n in range(len(busy))]
    for spec in batch:
        submit(client, spec)
    for spec in batch:
        wait_for(client, spec, State.DENOISING, min_step=2)
    interactive = make_spec(seed=600)
    submit(client, interactive)
    assert wait_done(client, interactive).state is State.DONE
    records = [wait_done(client, spec) for spec in batch]
    preempted = [r for r in records if r.counter("preemptions")]
    assert [r.counter("preemptions") for r in preempted] == [1]  # one job made way, once
    victim = preempted[0]
    # It finished after the interactive request, from a checkpoint, with the same output.
    assert float(victim.fields["updated_at"]) > float(
        wait_done(client, interactive).fields["updated_at"])
    assert victim.counter("resumed_from") > 0
    assert np.array_equal(read_frames(worker_settings, victim), reference(pipe, victim.spec))


def test_a_parked_request_resumes_on_another_worker_bit_identically(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path) -> None:
    spec, running, first = denoising(client, pool, seed=701, min_step=5)
    assert Lifecycle(client).ask_preempt(spec.tenant, spec.request_id, PreemptMode.PARK)
    parked = wait_for(client, spec, State.PREEMPTED)
    # The first worker leaves; whoever takes the resumed request is another one.
    first.stop()
    pool[Stage.DENOISE].remove(first)
    pool[Stage.DENOISE].append(start_worker(worker_settings, Stage.DENOISE, tmp_path, client,
                                            "denoise-after-park"))
    stopped = Records(client).get(spec.tenant, spec.request_id)
    assert stopped is not None
    Lifecycle(client).resume(stopped)
    record = wait_done(client, spec)
    assert record.state is State.DONE
    assert record.fields["worker:denoise"] != running["worker:denoise"]
    assert record.counter("resumed_from") >= int(parked["checkpoint_step"]) >= 5
    assert record.counter("preemptions") == 1 and record.counter("resumes") == 1
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def test_a_worker_paused_past_its_lease_writes_nothing_when_it_wakes(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path) -> None:
    spec, running, paused = denoising(client, pool, seed=801, min_step=3)
    assert paused.pid is not None
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        if not any(c.alive() and c is not paused for c in pool[Stage.DENOISE]):
            pool[Stage.DENOISE].append(start_worker(worker_settings, Stage.DENOISE, tmp_path,
                                                    client, "denoise-takeover"))
        record = wait_done(client, spec)  # taken over once the lease ran out
        before = client.hgetall(request_record(spec.tenant, spec.request_id))
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    time.sleep(2.0)  # the woken worker finishes its step, learns it is stale, and stops
    assert client.hgetall(request_record(spec.tenant, spec.request_id)) == before
    assert record.state is State.DONE and record.fields["attempt:denoise"] == "2"
    assert record.fields["worker:denoise"] != running["worker:denoise"]
    assert decode_entries_for(client, spec) == 1
    cache = open_cache(worker_settings)
    try:  # the paused attempt's latents never landed (or were removed)
        assert not cache.exists(latents_key(spec.tenant, spec.request_id, 1))
    finally:
        cache.close()
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))
    assert paused.alive()


def test_no_accepted_request_is_lost_when_valkey_restarts_mid_workload(
        worker_settings: Settings, client: redis.Redis, pool: object,
        embedded_stack: EmbeddedStack) -> None:
    specs = [make_spec(seed=900 + n, num_inference_steps=12) for n in range(6)]
    for spec in specs:
        submit(client, spec)
    wait_for(client, specs[0], State.DENOISING, min_step=2)
    valkey = embedded_stack.child("valkey")
    valkey.kill()  # a crash: only what the AOF fsynced survives
    valkey.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    records = [wait_done(client, spec, timeout_s=180) for spec in specs]
    assert [r.state for r in records] == [State.DONE] * len(specs)
