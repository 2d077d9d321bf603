"""The Qwen-Image family through the three workers, on a stack of its own: outputs are
bit-identical to ``QwenImagePipeline.from_pretrained(dir)(...)`` (one thread per op, CPU,
float32), also when resumed from each checkpoint and after ``kill -9`` of the denoise worker;
the API refuses video-only fields for an image family."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import GenerationSpec, StepCache, StepCachePolicy, StoreKey
from supervision.processes import ChildProcess
from tests.workers_harness import (
    embedded_serving,
    lose_output,
    make_spec,
    reference,
    rewind,
    run_request,
    serve_api,
    start_worker,
    stop_owner_when,
    wait_done,
    wait_for,
)
from training.magcache import calibrate
from workers.families import family_named, qwen_image
from workers.families.base import CPU
from workers.queue.messages import Stage
from workers.queue.schema import State
from workers.queue.served_model import MODEL_CARD, RequestDefaults
from workers.queue.submit import submit

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_settings(tmp_path_factory: pytest.TempPathFactory,
                  qwen_model_dir: Path) -> Iterator[Settings]:
    # Ratios for MagCache in the model's card, calibrated as for the shipped model, before any
    # worker reads the card.
    ratios = calibrate(qwen_model_dir, ["a red fox", "a small boat at sea"],
                       RequestDefaults(width=64, height=64, num_inference_steps=8))
    card = qwen_model_dir / MODEL_CARD
    card.write_text(json.dumps({"model": {"magcache_ratios": ratios}}))
    with embedded_serving(tmp_path_factory.mktemp("qwen-stack"), qwen_model_dir) as settings:
        yield settings


@pytest.fixture(scope="module")
def qwen_client(qwen_settings: Settings) -> redis.Redis:
    return open_redis(qwen_settings)


@pytest.fixture(scope="module")
def qwen_pool(qwen_settings: Settings, qwen_client: redis.Redis,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Stage, ChildProcess]]:
    logs = tmp_path_factory.mktemp("qwen-logs")
    workers = {stage: start_worker(qwen_settings, stage, logs, qwen_client, f"qwen-{stage}")
               for stage in Stage}
    yield workers
    for child in workers.values():
        child.stop()


@pytest.fixture(scope="module")
def qwen_pipe(qwen_model_dir: Path) -> Callable[[GenerationSpec], np.ndarray]:
    return family_named("qwen-image").reference(qwen_model_dir)


def image_spec(**changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(width=64, height=64, num_frames=1, num_inference_steps=6,
                                     guidance_scale=4.0, seed=7)
    fields.update(changes)
    return make_spec(**fields)


@pytest.mark.parametrize("changes", [
    {},
    {"guidance_scale": 1.0},
    {"negative_prompt": "", "seed": 99},
    {"width": 96, "height": 48, "prompt": "Two dogs, running on a BEACH!"},
], ids=["cfg", "no-cfg", "empty-negative", "wide"])
def test_outputs_are_bit_identical_to_the_qwen_image_pipeline(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_pipe: object, changes: dict[str, object]) -> None:
    spec = image_spec(**changes)
    frames = run_request(qwen_settings, qwen_client, spec)
    expected = reference(qwen_pipe, spec)
    assert frames.shape == expected.shape == (1, spec.height, spec.width, 3)
    assert np.array_equal(frames, expected)


def test_a_png_output_holds_the_same_pixels(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_pipe: object) -> None:
    import imageio.v3 as iio

    spec = image_spec(output_format="png", seed=5)
    submit(qwen_client, spec)
    record = wait_done(qwen_client, spec)
    assert record.state is State.DONE and record.output_key is not None
    cache = open_cache(qwen_settings)
    try:
        data = cache.get(StoreKey.parse(record.output_key), lookup=False)
    finally:
        cache.close()
    assert data is not None
    image = iio.imread(data.numpy().tobytes(), extension=".png")
    assert np.array_equal(image, reference(qwen_pipe, spec)[0])


def test_resuming_from_every_checkpoint_is_bit_identical(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_pipe: object) -> None:
    spec = image_spec(seed=21)
    expected = reference(qwen_pipe, spec)
    assert np.array_equal(run_request(qwen_settings, qwen_client, spec), expected)
    record = wait_done(qwen_client, spec)
    checkpoints = record.checkpoints()
    assert sorted(checkpoints) == [1, 2, 3, 4, 5, 6]
    cache = open_cache(qwen_settings)
    try:
        for k in range(6, 0, -1):
            rewind(qwen_settings, cache, record, k)
            again = image_spec(seed=21)
            frames = run_request(qwen_settings, qwen_client, again)
            assert wait_done(qwen_client, again).counter("resumed_from") == k
            assert np.array_equal(frames, expected), f"resumed from step {k}"
    finally:
        cache.close()


POLICIES = [StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.3),
            StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1),
            StepCache.create(StepCachePolicy.MAGCACHE, threshold=0.5)]


@pytest.mark.parametrize("step_cache", POLICIES, ids=lambda c: c.policy.value)
def test_a_step_cache_is_bit_identical_to_the_pipeline_with_its_hook_from_every_checkpoint(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_pipe: object, step_cache: StepCache) -> None:
    """The hook's state travels in each checkpoint: a resume from any of them gives what the
    uninterrupted run (and the pipeline with the same hook enabled) gives."""
    spec = image_spec(seed=23, num_inference_steps=8, step_cache=step_cache)
    expected = reference(qwen_pipe, spec)
    assert not np.array_equal(expected, reference(qwen_pipe, image_spec(seed=23,
                                                                          num_inference_steps=8)))
    assert np.array_equal(run_request(qwen_settings, qwen_client, spec), expected)
    record = wait_done(qwen_client, spec)
    assert record.counter("lookups:step") == 16  # every forward of 8 guided steps
    assert 0 < record.counter("hits:step") < 16
    assert record.counter("lookups:cfg") == 0  # the exact tier cannot see hook state
    cache = open_cache(qwen_settings)
    try:
        for k in range(7, 0, -1):
            rewind(qwen_settings, cache, record, k)
            again = image_spec(seed=23, num_inference_steps=8, step_cache=step_cache)
            frames = run_request(qwen_settings, qwen_client, again)
            assert wait_done(qwen_client, again).counter("resumed_from") == k
            assert np.array_equal(frames, expected), f"resumed from step {k}"
    finally:
        cache.close()


def test_a_step_cache_request_never_finds_the_exact_trajectory(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_pipe: object) -> None:
    exact = image_spec(seed=29)
    run_request(qwen_settings, qwen_client, exact)
    cached = image_spec(seed=29, step_cache=POLICIES[0])
    frames = run_request(qwen_settings, qwen_client, cached)
    record = wait_done(qwen_client, cached)
    assert record.counter("resumed_from") == 0 and record.counter("hits:ckpt") == 0
    assert record.output_key != wait_done(qwen_client, exact).output_key
    assert np.array_equal(frames, reference(qwen_pipe, cached))
    # Same policy, same parameters: the prefix is shared.
    same = image_spec(seed=29, step_cache=POLICIES[0])
    run_request(qwen_settings, qwen_client, same)
    assert wait_done(qwen_client, same).output_key == record.output_key


@pytest.mark.parametrize("step_cache", [StepCache(), POLICIES[0]],
                         ids=lambda c: c.policy.value)
def test_a_killed_denoise_worker_is_recovered_bit_identically(
        qwen_settings: Settings, qwen_client: redis.Redis,
        qwen_pool: dict[Stage, ChildProcess], qwen_pipe: object, tmp_path: Path,
        step_cache: StepCache) -> None:
    spec = image_spec(seed=77, num_inference_steps=60, step_cache=step_cache)
    submit(qwen_client, spec)
    # Stopped once its record reports the checkpoint at step 6, then killed there.
    victim, _ = stop_owner_when(qwen_client, spec, Stage.DENOISE, [qwen_pool[Stage.DENOISE]],
                                lambda f: int(f.get("checkpoint_step", 0)) >= 6)
    victim.kill()
    qwen_pool[Stage.DENOISE] = start_worker(qwen_settings, Stage.DENOISE, tmp_path,
                                            qwen_client, "qwen-denoise-replacement")
    record = wait_done(qwen_client, spec)
    assert record.state is State.DONE
    assert record.fields["attempt:denoise"] == "2" and record.counter("resumed_from") >= 6
    assert np.array_equal(run_frames(qwen_settings, record), reference(qwen_pipe, spec))


def run_frames(settings: Settings, record: object) -> np.ndarray:
    from tests.workers_harness import read_frames

    return read_frames(settings, record)  # type: ignore[arg-type]


def test_the_api_refuses_video_fields_for_an_image_family(
        qwen_settings: Settings, qwen_pool: object) -> None:
    with serve_api(qwen_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        for body, field in (({"num_frames": 5}, "num_frames"),
                            ({"output_format": "mp4"}, "output_format")):
            answer = http.post("/v1/generate", json={"prompt": "a red fox", **body})
            assert answer.status_code == 422, answer.text
            assert answer.json()["field"] == field
            assert "qwen-image" in answer.json()["error"]
        # Tokens as the served model's BPE counts them: 200 words, well over 507 tokens.
        long = http.post("/v1/generate", json={"prompt": "qzxv " * 200})
        assert long.status_code == 422 and long.json()["field"] == "prompt"
        assert "at most 507 tokens" in long.json()["error"]
        ok = http.post("/v1/generate", json={"prompt": "a red fox", "output_format": "png",
                                             "num_frames": 1, "width": 64, "height": 64})
        assert ok.status_code == 202, ok.text
        status = http.get(f"/v1/requests/{ok.json()['id']}").json()
        assert status["model"] == {"family": "qwen-image", "name": "qwen-model0"}


def test_a_parked_request_resumes_bit_identically_and_an_edit_branches(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: dict[Stage, ChildProcess],
        qwen_pipe: object) -> None:
    from keys import PromptSegment
    from workers.queue.lifecycle import Lifecycle
    from workers.queue.records import Records
    from workers.queue.schema import PreemptMode
    from workers.queue.submit import new_request_id

    spec = image_spec(seed=311, num_inference_steps=60)
    submit(qwen_client, spec)
    # Asked while its worker is stopped three steps in, so the request cannot finish first.
    worker, _ = stop_owner_when(qwen_client, spec, Stage.DENOISE, [qwen_pool[Stage.DENOISE]],
                                lambda f: int(f.get("step", 0)) >= 3)
    lifecycle = Lifecycle(qwen_client)
    try:
        assert lifecycle.ask_preempt(spec.tenant, spec.request_id, PreemptMode.PARK)
    finally:
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(qwen_client, spec, State.PREEMPTED)  # fails at once, with the record, if it ends
    parked = Records(qwen_client).get(spec.tenant, spec.request_id)
    assert parked is not None
    lifecycle.resume(parked)
    record = wait_done(qwen_client, spec)
    assert record.counter("resumed_from") > 0 and record.counter("preemptions") == 1
    from tests.workers_harness import read_frames

    assert np.array_equal(read_frames(qwen_settings, record), reference(qwen_pipe, spec))
    # An edit of the second half branches from the shared checkpoint at its switch.
    tail = (PromptSegment("a white owl at night", "blurry", 60),)
    branch = spec.branch(new_request_id(), 30, tail)
    run_request(qwen_settings, qwen_client, branch)
    assert wait_done(qwen_client, branch).counter("resumed_from") == 30


def test_an_edit_under_a_step_cache_gives_what_the_edited_request_computes_from_scratch(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object) -> None:
    """The branch resumes with the hook state the prefix's checkpoint holds: the same output
    as the edited request run from step 0 with nothing cached."""
    from keys import PromptSegment
    from workers.queue.submit import new_request_id

    spec = image_spec(seed=313, num_inference_steps=12, step_cache=POLICIES[0])
    run_request(qwen_settings, qwen_client, spec)
    branch = spec.branch(new_request_id(), 6, (PromptSegment("a white owl", "blurry", 12),))
    frames = run_request(qwen_settings, qwen_client, branch)
    record = wait_done(qwen_client, branch)
    assert record.counter("resumed_from") == 6
    cache = open_cache(qwen_settings)
    try:
        for key in [*wait_done(qwen_client, spec).checkpoints().values(),
                    *record.checkpoints().values()]:
            cache.remove(StoreKey.parse(key))
        lose_output(qwen_settings, cache, record)
    finally:
        cache.close()
    again = dataclasses.replace(branch, request_id=new_request_id())
    assert np.array_equal(run_request(qwen_settings, qwen_client, again), frames)
    assert wait_done(qwen_client, again).counter("resumed_from") == 0


def test_openai_images_and_the_output_cache_serve_the_image_family(
        qwen_settings: Settings, qwen_pool: object, qwen_pipe: object) -> None:
    import base64

    import imageio.v3 as iio

    body = {"prompt": "a green train at night", "size": "64x64", "seed": 4242,
            "num_inference_steps": 6, "model": "qwen-image"}
    with serve_api(qwen_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        first = http.post("/v1/images/generations", json=body, timeout=120)
        again = http.post("/v1/images/generations", json=body, timeout=120)
        # The repeat was answered from the output cache.
        wait_until(lambda: 'diffcache_cache_hits_total{kind="output",tenant="default"}'
                   in http.get("/metrics").text, timeout_s=30, interval_s=0.2,
                   what="an output-cache hit counted")
    assert first.status_code == again.status_code == 200, first.text
    images = [iio.imread(base64.b64decode(r.json()["data"][0]["b64_json"]), extension=".png")
              for r in (first, again)]
    spec = image_spec(prompt="a green train at night", negative_prompt="", seed=4242,
                      guidance_scale=RequestDefaults().guidance_scale)
    assert np.array_equal(images[0], images[1])
    assert np.array_equal(images[0], reference(qwen_pipe, spec)[0])


def test_an_adapter_applies_bit_identically_to_the_qwen_image_pipeline(
        qwen_settings: Settings, qwen_client: redis.Redis, qwen_pool: object,
        qwen_model_dir: Path) -> None:
    from bench.lora import random_lora
    from keys import LoraUse
    from tests.test_lora import upload

    state = random_lora(qwen_model_dir, seed=9, targets=("attn.to_q", "attn.to_v"))
    spec = image_spec(loras=(LoraUse(upload(qwen_settings, state, "acme"), 0.6),))
    frames = run_request(qwen_settings, qwen_client, spec)
    lora_pipe = qwen_image.FAMILY.reference(qwen_model_dir, CPU)
    lora_pipe.pipe.load_lora_weights(state, adapter_name="a")  # type: ignore[attr-defined]
    lora_pipe.pipe.set_adapters(["a"], [0.6])  # type: ignore[attr-defined]
    assert np.array_equal(frames, reference(lora_pipe, spec))


def test_rows_of_every_policy_and_adapter_set_share_forwards_each_its_pipelines(
        qwen_settings: Settings, qwen_client: redis.Redis,
        qwen_pool: dict[Stage, ChildProcess], qwen_model_dir: Path) -> None:
    """Requests under each step cache and none, with no adapters, one, and two, and prompts
    of different lengths (padded), offered together: they share forwards, each row deciding
    its skips and applying its adapters alone, and each output is its pipeline's with the
    same hook and adapters (CPU, float32, one thread per op)."""
    from bench.lora import random_lora
    from keys import LoraUse
    from tests.test_engine import batched_forwards, offered_together
    from tests.test_lora import upload

    states = [random_lora(qwen_model_dir, seed=s, targets=("attn.to_q", "attn.to_v"))
              for s in (11, 12)]
    a, b = (LoraUse(upload(qwen_settings, state, "acme"), scale)
            for state, scale in zip(states, (0.6, 0.9), strict=True))
    combos = [(POLICIES[0], ()), (POLICIES[1], (a,)), (POLICIES[2], (a, b)), (StepCache(), (b,)),
              (StepCache(), ()), (POLICIES[2], ())]
    prompts = ["a fox", "a red fox in the snow at night", "a small boat", "a cat",
               "an old stone bridge over a river", "a bowl of cherries"]
    specs = [image_spec(seed=41 + i, prompt=prompts[i], num_inference_steps=8, step_cache=cache,
                        loras=loras) for i, (cache, loras) in enumerate(combos)]
    before = batched_forwards(qwen_client)
    offered_together(qwen_client, qwen_pool[Stage.DENOISE], specs)
    records = [wait_done(qwen_client, spec) for spec in specs]
    assert batched_forwards(qwen_client) > before
    names = {a: "a", b: "b"}
    pipes: dict[tuple[LoraUse, ...], Any] = {}
    for spec, record in zip(specs, records, strict=True):
        assert record.state is State.DONE, record.error
        if spec.loras not in pipes:
            pipes[spec.loras] = adapted_pipe(qwen_model_dir, dict(zip("ab", states, strict=True)),
                                             [(names[u], u.scale) for u in spec.loras])
        frames = run_frames(qwen_settings, record)
        assert np.array_equal(frames, reference(pipes[spec.loras], spec)), spec.step_cache
        if spec.step_cache.on:
            assert record.counter("hits:step") > 0


def adapted_pipe(directory: Path, states: dict[str, dict[str, Any]],
                 uses: list[tuple[str, float]]) -> Any:
    """The pipeline with every adapter of ``states`` loaded and ``uses`` set (none: off)."""
    pipe: Any = qwen_image.FAMILY.reference(directory, CPU)
    for name, state in states.items():
        pipe.pipe.load_lora_weights(state, adapter_name=name)
    if uses:
        pipe.pipe.set_adapters([n for n, _ in uses], [s for _, s in uses])
    else:
        pipe.pipe.disable_lora()
    return pipe
