"""Image-to-video on a Wan model through the three workers: outputs bit-identical to
``WanImageToVideoPipeline`` over the same components (one thread per op, CPU, float32),
batched beside other images' rows, resumed with the image's condition lost, and under a step
cache; one condition encode per image and geometry, and CFG entries that never cross images;
the generate and video routes, and what they refuse, each naming the field."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import ApiSettings
from keys import (
    GenerationSpec,
    ImageInput,
    KeyKind,
    StepCache,
    StepCachePolicy,
    image_latent_key,
)
from tests.test_engine import batched_forwards, offered_together
from tests.test_img2img import lookups, picture, stored, uploaded
from tests.workers_harness import (
    ModelService,
    make_spec,
    model_service,
    read_frames,
    reference,
    rewind,
    run_request,
    serve_api,
    step_cache_is_the_pipelines,
    wait_done,
)
from uploads.images import normalise
from workers.families import wan_i2v
from workers.families.base import CPU
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import StageField, State
from workers.queue.submit import new_request_id, submit

pytestmark = pytest.mark.slow
TENANT = "i2v"


@pytest.fixture(scope="module")
def i2v(tmp_path_factory: pytest.TempPathFactory, i2v_model_dir: Path) -> Iterator[ModelService]:
    with model_service(tmp_path_factory.mktemp("i2v"), i2v_model_dir, "i2v") as service:
        yield service


@pytest.fixture(scope="module")
def i2v_pipe(i2v_model_dir: Path) -> Callable[..., np.ndarray]:
    return wan_i2v.FAMILY.reference(i2v_model_dir, CPU)


def animate(content_hash: str, **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(tenant=TENANT, num_frames=5, num_inference_steps=4,
                                     guidance_scale=5.0, seed=7,
                                     image=ImageInput(content_hash, strength=None))
    return make_spec(**(fields | changes))


def expected(pipe: Callable[..., np.ndarray], image: Image.Image,
             spec: GenerationSpec) -> np.ndarray:
    return reference(lambda s: pipe(s, image), spec)


def cfg_hits(client: redis.Redis, spec: GenerationSpec) -> int:
    return wait_done(client, spec).hits().get(KeyKind.CFG.value, 0)


def test_image_to_video_is_bit_identical_and_each_image_is_conditioned_once(
        i2v: ModelService, i2v_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(11)
    content_hash = stored(i2v.settings, image, TENANT)
    first = animate(content_hash)
    frames = run_request(i2v.settings, i2v.client, first)
    assert np.array_equal(frames, expected(i2v_pipe, image, first))
    record = wait_done(i2v.client, first)
    kind = KeyKind.IMAGE_LATENT.value
    assert lookups(record).get(kind) == 1 and record.hits().get(kind, 0) == 0

    # The same image under another prompt and seed: its condition is read, not encoded.
    second = animate(content_hash, prompt="a small boat at sea", seed=3)
    assert np.array_equal(run_request(i2v.settings, i2v.client, second),
                          expected(i2v_pipe, image, second))
    assert wait_done(i2v.client, second).hits().get(kind) == 1

    # Another image under the first's seed and negative prompt starts from the same noise:
    # its unconditional rows still take its own condition, so no CFG entry of the first image
    # stands in for them, while a third request on the first image finds its step-0 entry.
    other = picture(12)
    moved = animate(stored(i2v.settings, other, TENANT), prompt="a cat")
    moved_frames = run_request(i2v.settings, i2v.client, moved)
    assert np.array_equal(moved_frames, expected(i2v_pipe, other, moved))
    assert not np.array_equal(moved_frames, expected(i2v_pipe, image, moved))
    assert cfg_hits(i2v.client, moved) == 0
    third = animate(content_hash, prompt="a cat")
    assert np.array_equal(run_request(i2v.settings, i2v.client, third),
                          expected(i2v_pipe, image, third))
    assert cfg_hits(i2v.client, third) >= 1


def test_images_offered_together_share_forwards_and_each_matches_the_pipeline(
        i2v: ModelService, i2v_pipe: Callable[..., np.ndarray]) -> None:
    images = [picture(20 + i) for i in range(3)]
    specs = [animate(stored(i2v.settings, image, TENANT), prompt=prompt, seed=100 + i,
                     num_inference_steps=4 + 2 * i)
             for i, (image, prompt) in enumerate(zip(images, ["a fox", "a red fox", "a cat"],
                                                     strict=True))]
    before = batched_forwards(i2v.client)
    offered_together(i2v.client, i2v.pool[Stage.DENOISE][0], specs)
    records = [wait_done(i2v.client, spec) for spec in specs]
    assert batched_forwards(i2v.client) > before
    for image, record in zip(images, records, strict=True):
        assert record.state is State.DONE, record
        assert np.array_equal(read_frames(i2v.settings, record),
                              expected(i2v_pipe, image, record.spec))


def test_a_request_resumed_with_its_condition_lost_gives_the_same_bytes(
        i2v: ModelService, i2v_pipe: Callable[..., np.ndarray], i2v_model_dir: Path) -> None:
    image = picture(13)
    content_hash = stored(i2v.settings, image, TENANT)
    spec = animate(content_hash, seed=21, num_inference_steps=6)
    frames = run_request(i2v.settings, i2v.client, spec)
    assert np.array_equal(frames, expected(i2v_pipe, image, spec))
    record = wait_done(i2v.client, spec)
    cache = open_cache(i2v.settings)
    try:
        rewind(i2v.settings, cache, record, 3)
        encoder = wan_i2v.condition_fingerprint(i2v_model_dir, CPU)
        assert cache.remove(image_latent_key(TENANT, encoder, content_hash, (
            spec.width, spec.height, spec.num_frames)))
    finally:
        cache.close()
    repeat = dataclasses.replace(spec, request_id=new_request_id())
    assert np.array_equal(run_request(i2v.settings, i2v.client, repeat), frames)
    resumed = wait_done(i2v.client, repeat)
    assert resumed.fields["resumed_from"] == "3"
    assert resumed.hits().get(KeyKind.IMAGE_LATENT.value, 0) == 0  # encoded again


def test_a_request_whose_image_the_store_lost_fails_at_once_and_resumes_once_it_is_back(
        i2v: ModelService, i2v_pipe: Callable[..., np.ndarray]) -> None:
    """No retry brings an upload back: the request fails on its first delivery, saying how
    to recover, and a resume after the image is back gives the pipeline's video."""
    image = picture(16)
    png = io.BytesIO()
    image.save(png, format="PNG")
    spec = animate(normalise(png.getvalue(), 2**20, 2**20).hash, seed=51)  # never stored
    submit(i2v.client, spec)
    failed = wait_done(i2v.client, spec)
    assert failed.state is State.FAILED, failed
    assert spec.image is not None and spec.image.hash in failed.fields["error"]
    assert "resume" in failed.fields["error"]
    assert failed.fields[StageField.ATTEMPT.of(Stage.ENCODE)] == "1"  # not redelivered
    stored(i2v.settings, image, TENANT)
    Lifecycle(i2v.client).resume(failed)
    resumed = wait_done(i2v.client, spec)
    assert resumed.state is State.DONE, resumed
    assert np.array_equal(read_frames(i2v.settings, resumed), expected(i2v_pipe, image, spec))


def test_a_step_cache_on_image_to_video_is_the_pipelines(
        i2v: ModelService, i2v_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(14)
    cache = StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1)
    spec = animate(stored(i2v.settings, image, TENANT), seed=41, num_inference_steps=6,
                   step_cache=cache)
    step_cache_is_the_pipelines(i2v, lambda s: expected(i2v_pipe, image, s), spec)


def test_the_routes_take_an_image_to_animate_and_name_what_they_refuse(
        i2v: ModelService) -> None:
    png = io.BytesIO()
    picture(15).save(png, format="PNG")
    with serve_api(i2v.settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        content_hash = uploaded(http, png.getvalue())
        body = {"prompt": "a red fox", "image": content_hash, "width": 32, "height": 32,
                "num_frames": 5, "num_inference_steps": 3, "seed": 5, "output_format": "npy"}
        accepted = http.post("/v1/generate", json=body)
        assert accepted.status_code == 202, accepted.text
        tenant = i2v.settings.default_tenant
        record = wait_until(
            lambda: (r := Records(i2v.client).get(tenant, accepted.json()["id"])) is not None
            and r.state.terminal and r, timeout_s=120, what="the request done")
        assert record.state is State.DONE, record
        assert record.spec.image == ImageInput(content_hash, strength=None)

        # SGLang's video route: the image as input_reference, the same request.
        video = http.post("/v1/videos", json={"prompt": "a red fox", "size": "32x32",
                                              "num_frames": 5, "num_inference_steps": 3,
                                              "seed": 5, "input_reference": content_hash})
        assert video.status_code == 200, video.text
        queued = Records(i2v.client).get(tenant, video.json()["id"])
        assert queued is not None and queued.spec.image == record.spec.image

        without = {k: v for k, v in body.items() if k != "image"}
        for path, sent, field in [
            ("/v1/generate", without, "image"),  # this model animates an image: it needs one
            ("/v1/generate", body | {"strength": 0.5}, "strength"),
            ("/v1/generate", body | {"step_cache": {"policy": "magcache"}},
             "step_cache.policy"),
            ("/v1/videos", {"prompt": "a fox", "input_reference": "f" * 32},
             "input_reference"),
        ]:
            refused = http.post(path, json=sent)
            assert refused.status_code in (404, 422), refused.text
            assert field in refused.text, refused.text
        edits = http.post("/v1/images/edits", data={"prompt": "a fox"},
                          files={"image": ("fox.png", png.getvalue(), "image/png")})
        assert edits.status_code == 422 and "image" in edits.text, edits.text
        generations = http.post("/v1/images/generations", json={"prompt": "a fox"})
        assert generations.status_code == 422, generations.text
        assert generations.json()["error"]["param"] == "model", generations.text
