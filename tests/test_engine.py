"""The denoise engine over the real stack: requests offered together share transformer
forwards, and every one of them is bit-identical to the monolithic pipeline (CPU, float32, one
thread per op), whether it joined first or mid-way, and whatever happened to the others
(cancelled, or their worker killed)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from bench.lora import random_lora
from cachesvc.tensor_cache import TensorCache
from cachesvc.waiting import wait_until
from config.settings import ModelSettings, Settings, SettingsError, WorkerSettings, load_settings
from keys import GenerationSpec, LoraUse, StepCache, StepCachePolicy
from keys.names import consumer_group, stage_stream
from supervision.processes import ChildProcess
from tests.test_lora import TENANT, upload
from tests.test_preemption import decode_entries_for
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
from workers.engine import exact_rows
from workers.engine.exact_rows import rows_apart
from workers.engine.guidance import Row
from workers.engine.row_proof import RowProof
from workers.families import qwen_image, wan, wan_i2v
from workers.families.base import CPU
from workers.queue.credits import Credits
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Stage
from workers.queue.metrics.engine import read_occupancy, read_rows
from workers.queue.records import Records
from workers.queue.runtime import consumer_name
from workers.queue.schema import PreemptMode, State
from workers.queue.served_model import request_defaults
from workers.queue.submit import submit
from workers.stages.denoise import DenoiseHandler

# Prompts of different lengths; the negative prompt is the same, so unconditional rows of
# different requests share forwards while conditional ones group by length.
PROMPTS = ["a fox", "a red fox in the snow", "a cat", "a small boat on a wide grey sea",
           "a red fox in the rain"]
FIRST_BLOCK = StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.3)


@pytest.mark.parametrize("family", ["wan", "wan-i2v", "qwen-image"])
def test_every_row_of_a_batched_forward_is_that_row_alone(
        family: str, model_dir: Path, i2v_model_dir: Path, qwen_model_dir: Path) -> None:
    """The measurement the engine rests on, for every row: other inputs, other timesteps,
    other image conditions; and no forward records a graph for autograd."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model: Any
        if family == "wan":
            model = wan.WanDenoiser(model_dir, CPU)
            text_dim = model.transformer.config.text_dim
        elif family == "wan-i2v":
            model = wan_i2v.WanI2VDenoiser(i2v_model_dir, CPU)
            text_dim = model.transformer.config.text_dim
        else:
            model = qwen_image.QwenDenoiser(qwen_model_dir, CPU)
            text_dim = model.transformer.config.joint_attention_dim
        spec = make_spec(width=32, height=32, num_frames=5)
        g = torch.Generator().manual_seed(3)
        shape, condition_shape = model.latent_shape(spec), model.condition_shape(spec)
        latents = torch.randn((6, *shape[1:]), generator=g)
        embeds = torch.randn((6, 9, text_dim), generator=g)
        steps = torch.rand(6, generator=g) * 1000
        conditions = (None if condition_shape is None
                      else torch.randn((6, *condition_shape[1:]), generator=g))
        with rows_apart():
            batched = model.predict(latents, steps, embeds, spec, condition=conditions)
        assert not batched.requires_grad
        for i in range(6):
            alone = model.predict(latents[i:i + 1], steps[i:i + 1], embeds[i:i + 1], spec,
                                  condition=None if conditions is None else conditions[i:i + 1])
            assert torch.equal(batched[i:i + 1], alone), f"row {i}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["wan", "wan-i2v", "qwen-image"])
def test_a_warmed_up_engine_takes_its_first_batch_without_a_proof(
        family: str, model_dir: Path, i2v_model_dir: Path, qwen_model_dir: Path,
        cache: TensorCache, redis_client: redis.Redis) -> None:
    """The worker's warm-up proves, on synthetic rows, every batch size a forward may take at
    the served model's default request, as admission fills it in (these folders have no card:
    96x96, and nine frames where the family makes video, one where it makes images). A step's
    first forwards of real rows there (other texts, other timesteps) then run no proof, and
    each row is still that row alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory, fam, denoiser = {
            "wan": (model_dir, wan, wan.WanDenoiser),
            "wan-i2v": (i2v_model_dir, wan_i2v, wan_i2v.WanI2VDenoiser),
            "qwen-image": (qwen_model_dir, qwen_image, qwen_image.QwenDenoiser)}[family]
        model: Any = denoiser(directory, CPU)
        handler = DenoiseHandler(cache, model, WorkerSettings(max_batch=3),
                                 Credits(redis_client, 8))
        handler.warm_up(request_defaults(ModelSettings(), directory), fam.LIMITS)
        engine = handler.engine
        proofs = engine.executor.proof.verdicts
        # Batch sizes 2 to 12: two rows for each of three runs, and as many again riding along
        # (``ride_along``) where a step cache skips some.
        assert proofs == 11
        spec = make_spec(width=96, height=96, num_frames=9 if fam.LIMITS.video else 1)
        g = torch.Generator().manual_seed(5)
        tokens, width = model.text_shape()
        condition = model.condition_shape(spec)
        rows = {(i, 0): Row(torch.randn(model.latent_shape(spec), generator=g),
                            torch.rand((), generator=g) * 1000,
                            torch.randn((1, tokens - i if model.pads_text else tokens, width),
                                        generator=g), spec,
                            condition=None if condition is None
                            else torch.randn(condition, generator=g))
                for i in range(5)}
        out = engine.compute(rows).outputs
        assert engine.executor.proof.verdicts == proofs
        for slot, row in rows.items():
            alone = model.predict(row.latents, row.timestep.reshape(1), row.embeds, spec,
                                  condition=row.condition)
            assert torch.equal(out[slot], alone), f"row {slot}"
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildProcess]:
    """A denoise worker of this module's own (in the pool, so that other tests' ``only`` holds
    it too); the others stand aside while a test here runs."""
    child = start_worker(worker_settings, Stage.DENOISE, tmp_path_factory.mktemp("engine"),
                         client, "engine-0")
    pool[Stage.DENOISE].append(child)
    yield child
    pool[Stage.DENOISE].remove(child)
    child.stop()


@contextmanager
def only(engine: ChildProcess, pool: dict[Stage, list[ChildProcess]],
         client: redis.Redis, settings: Settings) -> Iterator[None]:
    """Denoise jobs go to ``engine`` alone for the block (the others are held stopped, and the
    block starts once their last reads have lapsed: Redis still hands entries to a blocked
    read of a stopped process)."""
    others = [c for c in pool[Stage.DENOISE] if c.alive() and c is not engine]
    for child in others:
        os.kill(child.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    names = {consumer_name(c.pid) for c in others}
    stream = stage_stream(Stage.DENOISE.value, "interactive")

    def lapsed() -> bool:
        consumers = client.xinfo_consumers(stream, consumer_group(Stage.DENOISE.value))
        return all(int(c["idle"]) > settings.workers.block_ms for c in consumers
                   if c["name"].decode() in names)

    wait_until(lapsed, timeout_s=60, what="the stopped workers' reads lapsed")
    try:
        yield
    finally:
        for child in others:
            os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]


@contextmanager
def held(worker: ChildProcess) -> Iterator[None]:
    """``worker`` takes nothing while the block runs, then takes what waits all at once."""
    os.kill(worker.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        yield
    finally:
        os.kill(worker.pid, signal.SIGCONT)  # type: ignore[arg-type]


def offered_together(client: redis.Redis, engine: ChildProcess,
                     specs: list[GenerationSpec]) -> None:
    """Submit ``specs`` while ``engine`` is stopped, so that it reads them in one go."""
    with held(engine):
        for spec in specs:
            submit(client, spec)
        for spec in specs:
            wait_for(client, spec, State.ENCODED)


def batched_forwards(client: redis.Redis) -> int:
    return sum(n for rows, n in read_rows(client).items() if rows > 1)


@pytest.mark.slow
def test_requests_offered_together_share_forwards_and_each_matches_the_pipeline(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object) -> None:
    specs = [make_spec(seed=1700 + i, prompt=p, negative_prompt="blurry",
                       num_inference_steps=4 + 2 * (i % 3))
             for i, p in enumerate(PROMPTS)]
    before = batched_forwards(client)
    with only(engine, pool, client, worker_settings):
        offered_together(client, engine, specs)
        wait_for(client, specs[0], State.DENOISING, min_step=2)
        late = make_spec(seed=1799, prompt="a fox", negative_prompt="blurry",
                         num_inference_steps=6)  # joins mid-way, at other steps than the rest
        submit(client, late)
        records = [wait_done(client, s) for s in [*specs, late]]
    assert {r.fields["worker:denoise"] for r in records} == {records[0].fields["worker:denoise"]}
    assert batched_forwards(client) > before
    for record in records:
        assert record.state is State.DONE
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))
    assert any(o.worker == records[0].fields["worker:denoise"] for o in read_occupancy(client))


@pytest.mark.slow
def test_a_run_cancelled_mid_batch_leaves_the_others_unchanged(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object) -> None:
    specs = [make_spec(seed=1800 + i, prompt=p, negative_prompt="blurry",
                       num_inference_steps=12) for i, p in enumerate(PROMPTS[:3])]
    with only(engine, pool, client, worker_settings):
        offered_together(client, engine, specs)
        wait_for(client, specs[1], State.DENOISING, min_step=2)
        assert Records(client).cancel(specs[1].tenant, specs[1].request_id)
        records = [wait_done(client, s) for s in specs]
    assert [r.state for r in records] == [State.DONE, State.CANCELLED, State.DONE]
    for record in (records[0], records[2]):
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))


def test_fewer_decode_credits_than_an_engine_holds_runs_are_refused_naming_the_field() -> None:
    with pytest.raises(SettingsError, match=r"workers\.decode_credits \(4\).*max_batch \(8\)"):
        load_settings(workers={"decode_credits": 4, "max_batch": 8})
    assert load_settings(workers={"denoise_workers": 3, "max_batch": 4}).workers.credit_limit == 24


@pytest.mark.slow
def test_a_full_engine_awaiting_decode_leaves_credits_for_the_next_batch(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object) -> None:
    """With decode stopped, a whole engine's runs finish denoising and wait for decode; the
    default credits still let the next runs step, so an engine's rows never sit idle behind
    one slow decode (with one engine's worth of credits, the last run here would wait)."""
    assert worker_settings.workers.decode_credits is None  # the default is what is tested
    specs = [make_spec(seed=2000 + i, prompt=PROMPTS[i % len(PROMPTS)], num_inference_steps=2)
             for i in range(worker_settings.workers.max_batch + 1)]
    with only(engine, pool, client, worker_settings), contextlib.ExitStack() as stopped:
        for decoder in pool[Stage.DECODE]:
            stopped.enter_context(held(decoder))
        for spec in specs:
            submit(client, spec)
        for spec in specs:
            wait_for(client, spec, State.DENOISED)
    records = [wait_done(client, s) for s in specs]
    assert all(r.state is State.DONE for r in records)
    assert np.array_equal(read_frames(worker_settings, records[-1]),
                          reference(pipe, records[-1].spec))


@pytest.mark.slow
def test_kill_9_of_a_worker_holding_a_batch_finishes_every_request_once(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        pipe: object, tmp_path: Path) -> None:
    victim = start_worker(worker_settings, Stage.DENOISE, tmp_path, client, "engine-victim")
    specs = [make_spec(seed=1900 + i, prompt=PROMPTS[i % len(PROMPTS)],
                       negative_prompt="blurry", num_inference_steps=40, width=64, height=64)
             for i in range(worker_settings.workers.max_batch)]  # a full batch
    try:
        with only(victim, pool, client, worker_settings):
            offered_together(client, victim, specs)
            # Stopped once every run of the batch is two steps in, killed there.
            stop_owner_when(client, specs[-1], Stage.DENOISE, [victim], lambda _: all(
                int(record_fields(client, s).get("step", 0)) >= 2 for s in specs))
            for spec in specs:
                fields = record_fields(client, spec)
                assert fields["state"] == State.DENOISING.value, fields
                assert (fields["worker:denoise"]
                        == record_fields(client, specs[0])["worker:denoise"])
            victim.kill()
    finally:
        victim.kill()  # also when an assertion failed while it was stopped
    records = [wait_done(client, s) for s in specs]  # taken over by the pool's workers
    for spec, record in zip(specs, records, strict=True):
        assert record.state is State.DONE
        assert decode_entries_for(client, spec) == 1  # published once
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


@pytest.mark.slow
def test_runs_with_and_without_an_adapter_share_forwards_each_its_pipelines(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, model_dir: Path, pipe: object) -> None:
    """Offered together, runs with an adapter and runs without it share forwards, each row
    applying its own run's adapter, and each matches its own pipeline."""
    state = random_lora(model_dir, seed=5)
    content_hash = upload(worker_settings, state)
    adapted = [make_spec(tenant=TENANT, seed=2000 + i, prompt=PROMPTS[i],
                         loras=(LoraUse(content_hash, 0.8),)) for i in range(2)]
    plain = [make_spec(tenant=TENANT, seed=2010 + i, prompt=PROMPTS[i]) for i in range(2)]
    # A step cache under an adapter: its hook runs on the adapted denoiser.
    cached = make_spec(tenant=TENANT, seed=2020, prompt=PROMPTS[2], step_cache=FIRST_BLOCK,
                       loras=(LoraUse(content_hash, 0.8),))
    specs = [adapted[0], plain[0], adapted[1], plain[1], cached]  # interleaved in the stream
    before = batched_forwards(client)
    with only(engine, pool, client, worker_settings):
        offered_together(client, engine, specs)
        records = [wait_done(client, s) for s in specs]
    assert batched_forwards(client) > before
    lora_pipe = wan.FAMILY.reference(model_dir, CPU)
    lora_pipe.pipe.load_lora_weights(state, adapter_name="a")  # type: ignore[attr-defined]
    lora_pipe.pipe.set_adapters(["a"], [0.8])  # type: ignore[attr-defined]
    for record in records:
        expected = reference(lora_pipe if record.spec.loras else pipe, record.spec)
        assert np.array_equal(read_frames(worker_settings, record), expected)


@pytest.mark.slow
def test_runs_with_and_without_step_caches_batched_together_each_match_their_pipeline(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object) -> None:
    """A run's skip decision is its own: runs under policies beside each other and beside
    plain runs that share forwards, each equal to the pipeline with its own hook (or none)."""
    caches = [StepCache(), FIRST_BLOCK,
              StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1), StepCache(),
              StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.5)]
    specs = [make_spec(seed=2100 + i, prompt=PROMPTS[i], num_inference_steps=6, step_cache=c)
             for i, c in enumerate(caches)]
    before = batched_forwards(client)
    with only(engine, pool, client, worker_settings):
        offered_together(client, engine, specs)
        records = [wait_done(client, s) for s in specs]
    assert batched_forwards(client) > before  # the plain runs shared forwards
    for record in records:
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))
        if record.spec.step_cache.on:
            assert record.counter("hits:step") > 0


@pytest.mark.slow
def test_runs_whose_step_cache_decides_alike_share_forwards_and_each_matches_the_pipeline(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object) -> None:
    """Runs under TaylorSeer share forwards, each row forecasting or computing by its own
    counters, and each row is what its run alone gives (the pipeline with the same hook)."""
    cache = StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1)
    specs = [make_spec(seed=2300 + i, prompt=PROMPTS[i], num_inference_steps=6,
                       step_cache=cache) for i in range(3)]
    before = batched_forwards(client)
    with only(engine, pool, client, worker_settings):
        offered_together(client, engine, specs)
        records = [wait_done(client, s) for s in specs]
    assert batched_forwards(client) > before  # no run without a policy was there to batch
    for record in records:
        assert record.counter("hits:step") > 0
        assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))


@pytest.mark.slow
@pytest.mark.parametrize("cache", [FIRST_BLOCK, StepCache.create(StepCachePolicy.TAYLORSEER,
                                                                 interval=2, warmup=1)],
                         ids=lambda c: c.policy.value)
def test_a_step_cache_run_parked_mid_batch_resumes_on_another_worker_bit_identically(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, list[ChildProcess]],
        engine: ChildProcess, pipe: object, cache: StepCache) -> None:
    """Parked while it shares forwards with a plain run, the run's state travels in its
    checkpoint: another worker resumes it to the pipeline's output under the same hook."""
    first = next(c for c in pool[Stage.DENOISE] if c is not engine and c.alive())
    # Seeds of their own per policy: a plain run computed under another parameter would be
    # an output hit here, never in the engine beside this one.
    seed = 2200 + 10 * list(StepCachePolicy).index(cache.policy)
    spec = make_spec(seed=seed, num_inference_steps=40, width=64, height=64, step_cache=cache)
    beside = make_spec(seed=seed + 1, num_inference_steps=40, width=64, height=64)
    lifecycle = Lifecycle(client)
    with only(first, pool, client, worker_settings):
        offered_together(client, first, [spec, beside])
        owner, _ = stop_owner_when(client, spec, Stage.DENOISE, [first],
                                   lambda f: int(f.get("step", 0)) >= 3)
        try:
            assert lifecycle.ask_preempt(spec.tenant, spec.request_id, PreemptMode.PARK)
        finally:
            os.kill(owner.pid, signal.SIGCONT)  # type: ignore[arg-type]
        wait_for(client, spec, State.PREEMPTED)
        wait_done(client, beside)
    parked = Records(client).get(spec.tenant, spec.request_id)
    assert parked is not None
    with only(engine, pool, client, worker_settings):
        lifecycle.resume(parked)
        record = wait_done(client, spec)
    assert record.fields["worker:denoise"] == consumer_name(engine.pid)  # type: ignore[arg-type]
    assert record.counter("resumed_from") >= 3 and record.counter("hits:step") > 0
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, spec))


def test_a_batch_whose_rows_differ_from_alone_is_refused_and_its_rows_run_alone() -> None:
    """The engine's proof on its own device: a batch size whose batched rows differ from the
    rows alone is never formed again for that geometry, and the rows alone are what the step
    takes."""
    proof = RowProof()
    alone = torch.arange(6.0).reshape(3, 2)
    assert proof.settle("g", alone.clone(), lambda: alone).equal(alone)
    assert proof.proven("g", 3) and proof.trusted("g", 3)
    # A larger batch is proven against forwards already proven: batches of 3, the rest alone.
    assert proof.largest_proven("g", below=7) == 3 and proof.largest_proven("g", below=3) == 1

    def not_again() -> torch.Tensor:
        raise AssertionError("a proven batch size is run alone again")

    assert proof.settle("g", alone.clone(), not_again).equal(alone)
    drifted = alone.clone()
    drifted[1, 0] += 1e-6
    assert proof.settle("h", drifted, lambda: alone).equal(alone)
    assert not proof.trusted("h", 3) and proof.trusted("g", 3)
    # Another size of the refused geometry is still tried: kernels are picked per size.
    assert proof.trusted("h", 2) and proof.usable("h", 4) == 4 and proof.usable("h", 3) == 2


def test_a_batched_product_that_rounds_unlike_its_samples_is_not_batched_again() -> None:
    """``rows_apart``'s own check, per shape: the first batched call of a shape tries its ways
    cheapest first against its samples alone and keeps the first that matched; a shape that
    none matched is computed one sample at a time."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 5, 32, generator=g), torch.randn(24, 32, generator=g)
    alone = torch.cat([torch.nn.functional.linear(x[i:i + 1], weight) for i in range(3)])
    shape = ("linear", 5, 32, 24, 3, x.stride(), x.dtype, x.device, False,
             exact_rows.alignment(x, weight, None))
    exact_rows._CHECKED.pop(shape, None)
    try:
        # Equal to the samples alone whatever this CPU's verdict.
        assert torch.equal(exact_rows._linear_per_sample(x, weight, None), alone)
        assert shape in exact_rows._CHECKED
        exact_rows._CHECKED.pop(shape)
        drifted = alone + 1e-6

        def never() -> torch.Tensor:
            raise AssertionError("a way that was not chosen is tried again")

        assert exact_rows._checked(shape, (lambda: drifted, alone.clone),
                                   lambda: alone).equal(alone)
        assert exact_rows._CHECKED[shape] == 1
        assert exact_rows._checked(shape, (never, lambda: alone), never).equal(alone)
        exact_rows._CHECKED.pop(shape)
        assert exact_rows._checked(shape, (lambda: drifted,), lambda: alone) is alone
        assert exact_rows._CHECKED[shape] == exact_rows.ALONE
        assert exact_rows._checked(shape, (never,), lambda: alone) is alone
    finally:
        exact_rows._CHECKED.pop(shape, None)
