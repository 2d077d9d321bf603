"""Step checkpoints over real workers: resuming from any of them, branching an edited schedule
from one, and recovering a killed worker from the latest one all give bit-identical output."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import PromptSegment, StoreKey
from supervision.processes import ChildProcess
from tests.workers_harness import (
    lose_output,
    make_spec,
    read_frames,
    reference,
    rewind,
    run_request,
    start_worker,
    stop_owner_when,
    wait_done,
)
from workers.engine.checkpoint import Checkpoint
from workers.families import family_named
from workers.queue.messages import Stage
from workers.queue.schema import State
from workers.queue.submit import new_request_id, submit
from workers.stages.trajectory import checkpoint_every

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["wan", "qwen-image"])
def test_a_checkpoint_round_trips_the_whole_scheduler_state(
        family: str, model_dir: Path, qwen_model_dir: Path) -> None:
    directory = model_dir if family == "wan" else qwen_model_dir
    trajectory = family_named(family).trajectory(directory)
    spec = make_spec(num_inference_steps=5)

    def advance(scheduler: Any, x: torch.Tensor, steps: range) -> torch.Tensor:
        for i in steps:  # any deterministic stand-in for the model's prediction
            x = scheduler.step(torch.tanh(x) * (i + 1), scheduler.timesteps[i], x,
                               return_dict=False)[0]
        return x

    scheduler, rng = trajectory.scheduler(spec), torch.Generator().manual_seed(1)
    halfway = advance(scheduler, torch.randn(1, 4, 2, 3, 3, generator=rng), range(3))
    hooks = {"cond": ({"head_block_residual": torch.full((1, 3), 2.0), "current_step": 2},
                      None)}
    fields = trajectory.scheduler_fields
    saved = Checkpoint.capture(3, halfway, fields.capture(scheduler), rng, torch.ones(2), 0.5,
                               hooks).to_bytes()
    expected = advance(scheduler, halfway, range(3, 5))

    restored = Checkpoint.from_bytes(saved)
    fresh_scheduler, fresh_rng = trajectory.scheduler(spec), torch.Generator()
    fields.restore(fresh_scheduler, restored.scheduler, torch.device("cpu"))
    fresh_rng.set_state(restored.rng)
    assert torch.equal(advance(fresh_scheduler, restored.latents, range(3, 5)), expected)
    assert torch.equal(fresh_rng.get_state(), rng.get_state())
    assert restored.cfg_residual is not None and torch.equal(restored.cfg_residual,
                                                             torch.ones(2))
    assert (restored.step, restored.compute_s) == (3, 0.5)
    hook = restored.hooks["cond"][0]
    assert restored.hooks["cond"][1] is None and hook is not None
    assert hook["current_step"] == 2
    assert torch.equal(hook["head_block_residual"], torch.full((1, 3), 2.0))


def test_resuming_from_every_checkpoint_is_bit_identical(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object) -> None:
    spec = make_spec(seed=21, num_inference_steps=6)
    expected = reference(pipe, spec)
    assert np.array_equal(run_request(worker_settings, client, spec), expected)
    record = wait_done(client, spec)
    checkpoints = record.checkpoints()
    assert sorted(checkpoints) == [1, 2, 3, 4, 5, 6]  # a tenth of 6 steps rounds up to 1
    cache = open_cache(worker_settings)
    try:
        for k in range(6, 0, -1):  # h(6): nothing left to compute but the decode
            # Leave h(k) as the furthest checkpoint and drop the output, so the same
            # trajectory under a new request id resumes at step k.
            for step, key in checkpoints.items():
                if step > k:
                    cache.remove(StoreKey.parse(key))
            lose_output(worker_settings, cache, record)
            again = make_spec(seed=21, num_inference_steps=6)
            frames = run_request(worker_settings, client, again)
            resumed = wait_done(client, again)
            assert resumed.counter("resumed_from") == k
            # Steps k..6 ran before on the same latents: the exact CFG tier serves them all.
            assert resumed.counter("hits:cfg") == resumed.counter("lookups:cfg") == 6 - k
            assert np.array_equal(frames, expected), f"resumed from step {k}"
    finally:
        cache.close()


def test_a_checkpoint_holding_state_its_scheduler_does_not_keep_is_passed_over(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object) -> None:
    """As one written under another scheduler or diffusers would: dropped, and the request
    resumes from the checkpoint before it, bit-identical, instead of failing on every try."""
    spec = make_spec(seed=23, num_inference_steps=4)
    expected = reference(pipe, spec)
    run_request(worker_settings, client, spec)
    record = wait_done(client, spec)
    cache = open_cache(worker_settings)
    try:
        rewind(worker_settings, cache, record, 3)
        key = StoreKey.parse(record.checkpoints()[3])
        stored = cache.get(key, lookup=False)
        assert stored is not None
        found = Checkpoint.from_bytes(stored.numpy().tobytes())
        foreign = dataclasses.replace(found, scheduler={**found.scheduler, "sigma_cache": 1})
        cache.remove(key)
        cache.put(key, torch.frombuffer(bytearray(foreign.to_bytes()), dtype=torch.uint8))
        again = make_spec(seed=23, num_inference_steps=4)
        frames = run_request(worker_settings, client, again)
        assert wait_done(client, again).counter("resumed_from") == 2
        assert np.array_equal(frames, expected)
    finally:
        cache.close()


def test_an_edited_schedule_branches_from_the_shared_prefix(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    base = make_spec(prompt="a red fox in the snow", seed=31, num_inference_steps=6)
    run_request(worker_settings, client, base)
    tail = (PromptSegment("a white owl at night", "blurry", 6),)
    branch = base.branch(new_request_id(), 3, tail)
    frames = run_request(worker_settings, client, branch)
    record = wait_done(client, branch)
    assert record.counter("resumed_from") == 3  # the first three steps were not computed
    # The same schedule in another tenant shares no checkpoint: computed from step 0.
    fresh = dataclasses.replace(branch, request_id=new_request_id(), tenant="other")
    assert np.array_equal(run_request(worker_settings, client, fresh), frames)
    assert wait_done(client, fresh).counter("resumed_from") == 0


def test_a_killed_denoise_worker_resumes_from_its_latest_checkpoint(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path) -> None:
    spec = make_spec(seed=78, num_inference_steps=40, width=64, height=64)
    every = checkpoint_every(spec, worker_settings.workers.checkpoint_every)
    submit(client, spec)

    def past_second_checkpoint(fields: dict[str, str]) -> bool:
        """A moment past the second checkpoint, with no checkpoint write outstanding."""
        step, saved = int(fields.get("step", 0)), int(fields.get("checkpoint_step", 0))
        return saved >= 2 * every and step - saved <= every

    # Stopped where its own progress report says it is, then killed there.
    victim, fields = stop_owner_when(client, spec, Stage.DENOISE, pool[Stage.DENOISE],
                                     past_second_checkpoint)
    step, saved = int(fields["step"]), int(fields["checkpoint_step"])
    victim.kill()
    pool[Stage.DENOISE].remove(victim)
    pool[Stage.DENOISE].append(start_worker(worker_settings, Stage.DENOISE, tmp_path, client,
                                            "denoise-after-kill"))
    record = wait_done(client, spec)
    assert record.state is State.DONE
    resumed_from = record.counter("resumed_from")
    assert resumed_from >= saved > 0  # not from step 0
    assert step - resumed_from <= every  # at most one checkpoint interval redone
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def test_a_start_without_a_checkpoint_counts_a_checkpoint_miss(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    from cachesvc.counters import read_totals

    first = make_spec(tenant="ckpt-counts", seed=4401, num_inference_steps=4)
    run_request(worker_settings, client, first)
    again = make_spec(tenant="ckpt-counts", seed=4401, num_inference_steps=4)
    cache = open_cache(worker_settings)
    try:  # drop the output, so the repeat denoises and finds the last checkpoint
        lose_output(worker_settings, cache, wait_done(client, first))
    finally:
        cache.close()
    run_request(worker_settings, client, again)
    wait_until(lambda: read_totals(client, "ckpt-counts").get("ckpt.lookups", 0) >= 2,
               timeout_s=30, what="both checkpoint lookups counted")
    totals = read_totals(client, "ckpt-counts")
    assert totals["ckpt.lookups"] == 2  # one per denoise start, found or not
    assert totals["ckpt.misses"] == 1 and totals["ckpt.hits"] == 1
