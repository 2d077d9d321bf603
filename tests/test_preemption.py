"""Priorities, preemption, resume, fencing and flow control over the real stack and workers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import redis

from bench.lora import random_lora
from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import GenerationSpec, LoraUse, latents_key
from keys.names import decode_credits, request_record, stage_stream
from supervision.processes import ChildProcess
from supervision.stack import EmbeddedStack
from tests.test_lora import upload
from tests.workers_harness import (
    make_spec,
    read_frames,
    record_fields,
    reference,
    start_worker,
    stop_owner_when,
    wait_done,
    wait_for,
)
from workers.families import wan
from workers.families.base import CPU
from workers.queue.credits import Credits
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Job, Stage
from workers.queue.records import Records
from workers.queue.schema import LATE_PREFIX, PreemptMode, State, is_counter
from workers.queue.submit import submit

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

LONG = {"num_inference_steps": 40, "width": 64, "height": 64}


def denoising(client: redis.Redis, pool: dict[Stage, list[ChildProcess]], seed: int,
              min_step: int, **changes: object) -> tuple[GenerationSpec, dict[str, str],
                                                         ChildProcess]:
    """A long request whose denoise worker has reported ``min_step`` steps, with that worker
    stopped (SIGSTOP) right there: the record as it left it, and the worker, which the caller
    lets go on (SIGCONT) or keeps stopped."""
    spec = make_spec(seed=seed, **LONG, **changes)
    submit(client, spec)
    stopped, running = stop_owner_when(
        client, spec, Stage.DENOISE, pool[Stage.DENOISE],
        lambda f: f.get("state") == State.DENOISING.value and int(f.get("step", 0)) >= min_step)
    return spec, running, stopped


def go_on(worker: ChildProcess) -> None:
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGCONT)


def decode_entries_for(client: redis.Redis, spec: GenerationSpec) -> int:
    entries = client.xrange(stage_stream(Stage.DECODE.value, spec.priority.value))
    return sum(Job.from_json(f[b"job"]).request_id == spec.request_id for _, f in entries)


def test_denoise_waits_for_a_decode_credit(worker_settings: Settings, client: redis.Redis,
                                          pool: object) -> None:
    credits = Credits(client, worker_settings.workers.credit_limit)
    holders = [f"holder{n}" for n in range(credits.limit)]
    for holder in holders:  # every credit taken by a trajectory still denoising
        client.hset(request_record("acme", holder), "state", "DENOISING")
        assert credits.acquire("acme", holder, 0)
    spec = make_spec(seed=950)
    submit(client, spec)
    wait_for(client, spec, State.DENOISING)
    wait_until(lambda: record_fields(client, spec).get("waiting") == "decode credit",
               timeout_s=30, what="the denoise worker waiting for a decode credit")
    # It keeps asking and is refused each time. Every ask drops holders whose request is gone,
    # so a planted holder without a record vanishing is the worker asking again (twice, so
    # once after a whole turn of its wait loop), while every real credit stays taken.
    gone = request_record("acme", f"gone-{spec.request_id}")
    for turn in range(2):
        client.zadd(decode_credits(), {gone: 0})
        wait_until(lambda: client.zscore(decode_credits(), gone) is None, timeout_s=30,
                   what=f"the waiting worker asking for a credit again ({turn + 1})")
    held = Records(client).get(spec.tenant, spec.request_id)
    assert held is not None and held.state is State.DENOISING and held.step == 0
    assert held.fields.get("waiting") == "decode credit"
    client.hset(request_record("acme", holders[0]), "state", "DONE")  # one decode finished
    assert wait_done(client, spec).state is State.DONE
    for holder in holders[1:]:
        credits.release("acme", holder)


def test_interactive_work_joins_a_running_batch_job_at_the_next_step(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object) -> None:
    # Long enough that the interactive request's whole path (encode, its 4 steps, decode)
    # ends well before it, on a loaded machine too.
    batch = make_spec(seed=480, priority="batch", **{**LONG, "num_inference_steps": 120})
    submit(client, batch)
    wait_for(client, batch, State.DENOISING, min_step=2)
    interactive = make_spec(seed=481)
    submit(client, interactive)
    done = wait_done(client, interactive)
    beside = Records(client).get(batch.tenant, batch.request_id)
    assert beside is not None and beside.state is State.DENOISING  # still running beside it
    assert done.fields["worker:denoise"] == beside.fields["worker:denoise"]  # in one engine
    finished = wait_done(client, batch)
    assert finished.counter("preemptions") == 0 and done.counter("preemptions") == 0
    for record in (done, finished):
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))


def test_waiting_interactive_work_preempts_one_batch_job_when_the_engine_is_full(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object) -> None:
    busy = [c for c in pool[Stage.DENOISE] if c.alive()]
    batch = [make_spec(seed=500 + n, priority="batch", **LONG)
             for n in range(len(busy) * worker_settings.workers.max_batch)]
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


@pytest.mark.parametrize("adapted", [False, True], ids=["base", "lora"])
def test_a_parked_request_resumes_on_another_worker_bit_identically(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path, model_dir: Path, adapted: bool) -> None:
    changes: dict[str, object] = {}
    if adapted:  # the other worker loads the same adapter from the store: still bit-exact
        state = random_lora(model_dir, seed=5)
        changes["loras"] = (LoraUse(upload(worker_settings, state, "acme"), 0.9),)
        lora_pipe = wan.FAMILY.reference(model_dir, CPU)
        lora_pipe.pipe.load_lora_weights(state, adapter_name="a")
        lora_pipe.pipe.set_adapters(["a"], [0.9])
        pipe = lora_pipe
    spec, running, first = denoising(client, pool, seed=701, min_step=5, **changes)
    try:  # asked while its worker is stopped mid-job, so it cannot finish first
        assert Lifecycle(client).ask_preempt(spec.tenant, spec.request_id, PreemptMode.PARK)
    finally:
        go_on(first)
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
    try:
        if not any(c.alive() and c is not paused for c in pool[Stage.DENOISE]):
            pool[Stage.DENOISE].append(start_worker(worker_settings, Stage.DENOISE, tmp_path,
                                                    client, "denoise-takeover"))
        record = wait_done(client, spec)  # taken over once the lease ran out
        before = client.hgetall(request_record(spec.tenant, spec.request_id))
    finally:
        go_on(paused)
    # The woken worker goes on until a fenced write tells it that it is stale, then offers
    # its result, which the fence refuses: the worker logs that, and discards what it made.
    # That log line is the event waited for; the deadline only bounds a hang, and a store
    # read whose lease ran out while the worker was stopped is read again, not a failure.
    refused = f"request {spec.request_id}: result of stale attempt"
    wait_until(lambda: refused in paused.log_path.read_text(errors="replace"), timeout_s=300,
               interval_s=0.05, what="the woken worker's stale result refused")
    # The record ended before the refused attempt wrote: it is final. The attempt's lookups,
    # which the cache counters counted, are kept apart under late:<counter>.
    after = client.hgetall(request_record(spec.tenant, spec.request_id))
    late = {k: v for k, v in after.items() if k.decode().startswith(f"{LATE_PREFIX}:")}
    assert {k: v for k, v in after.items() if k not in late} == before
    assert all(is_counter(k.decode().removeprefix(f"{LATE_PREFIX}:")) for k in late)
    assert record.state is State.DONE and record.fields["attempt:denoise"] == "2"
    assert record.fields["worker:denoise"] != running["worker:denoise"]
    assert decode_entries_for(client, spec) == 1
    cache = open_cache(worker_settings)
    try:  # the paused attempt's latents never landed, or its discard (just after the log
        # line) removes them
        stale = latents_key(spec.tenant, spec.request_id, 1)
        wait_until(lambda: not cache.exists(stale), timeout_s=10,
                   what="no latents of the stale attempt")
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

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:  # refused, or still loading its AOF
            return False

    wait_until(answers, timeout_s=20, interval_s=0.1, what="Valkey answering again")
    records = [wait_done(client, spec, timeout_s=180) for spec in specs]
    assert [r.state for r in records] == [State.DONE] * len(specs)
