"""Image-to-image on the Qwen-Image family through the three workers: outputs bit-identical to
``QwenImageImg2ImgPipeline`` over the same components (one thread per op, CPU, float32),
also when parked and resumed, branched by an edit, and resumed from a checkpoint with the
image's encoding lost; one VAE encode per image and size; the generate route, the command line
and OpenAI's ``images.edit`` (from the official client), and their refusals, each naming the
field."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import imageio.v3 as iio
import numpy as np
import openai
import pytest
import redis
import torch
from PIL import Image
from typer.testing import CliRunner

from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from cli.main import app
from config.settings import ApiSettings, Settings
from keys import (
    GenerationSpec,
    ImageInput,
    KeyKind,
    PromptSegment,
    StepCache,
    StepCachePolicy,
    image_key,
    image_latent_key,
)
from supervision.processes import ChildProcess
from tests.workers_harness import (
    answered_record,
    embedded_serving,
    make_spec,
    read_frames,
    reference,
    rewind,
    run_request,
    serve_api,
    stop_owner_when,
    wait_done,
    wait_for,
    worker_pool,
)
from uploads.images import normalise
from workers.families import family_named, qwen_image
from workers.families.base import CPU
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import KindField, PreemptMode, RequestRecord, State
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy

pytestmark = pytest.mark.slow
TENANT = "img2img"
OTHER = "img2img-other"  # shares nothing with TENANT, so computes everything itself


@pytest.fixture(scope="module")
def img_settings(tmp_path_factory: pytest.TempPathFactory,
                 qwen_model_dir: Path) -> Iterator[Settings]:
    with embedded_serving(tmp_path_factory.mktemp("img2img-stack"), qwen_model_dir) as settings:
        yield settings


@pytest.fixture(scope="module")
def img_client(img_settings: Settings) -> redis.Redis:
    return open_redis(img_settings)


@pytest.fixture(scope="module")
def img_pool(img_settings: Settings, img_client: redis.Redis,
             tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[Stage, list[ChildProcess]]]:
    with worker_pool(img_settings, img_client, tmp_path_factory.mktemp("img2img-logs"),
                     "img") as workers:
        yield workers


@pytest.fixture(scope="module")
def img_pipe(qwen_model_dir: Path) -> Callable[..., np.ndarray]:
    return family_named("qwen-image").reference(qwen_model_dir)


def picture(seed: int, size: int = 48) -> Image.Image:
    """Coloured blocks, smoothed by the resize to the request's size: not a square of it, so
    the pipeline's resize does something."""
    blocks = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize((size, size // 2 * 3), Image.Resampling.NEAREST)


def stored(settings: Settings, image: Image.Image, tenant: str = TENANT) -> str:
    """Put ``image`` in the store as ``POST /v1/images`` keeps it; its hash."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    kept = normalise(out.getvalue(), 2**20, 2**20)
    cache = open_cache(settings)
    try:
        cache.put(image_key(tenant, kept.hash),
                  torch.frombuffer(bytearray(kept.png), dtype=torch.uint8))
    finally:
        cache.close()
    return kept.hash


def uploaded(http: httpx.Client, png: bytes) -> str:
    """``png`` through ``POST /v1/images`` of a new API; its hash. The API connects to the
    store in the background: 503 until it has."""
    answer = wait_until(lambda: (r := http.post("/v1/images", content=png))
                        .status_code != 503 and r, timeout_s=60,
                        what="the API's store connected")
    assert answer.status_code == 201, answer.text
    content_hash: str = answer.json()["hash"]
    return content_hash


def lookups(record: RequestRecord) -> dict[str, int]:
    return record.per_kind(KindField.LOOKUPS)


def edit(content_hash: str, strength: float, **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(tenant=TENANT, width=64, height=64, num_frames=1,
                                     num_inference_steps=6, guidance_scale=4.0, seed=7,
                                     image=ImageInput(content_hash, strength))
    fields.update(changes)
    return make_spec(**fields)


def test_image_to_image_is_bit_identical_and_each_image_is_encoded_once(
        img_settings: Settings, img_client: redis.Redis, img_pipe: Callable[..., np.ndarray],
        img_pool: object) -> None:
    image = picture(1)
    content_hash = stored(img_settings, image)
    first = edit(content_hash, 0.6)
    frames = run_request(img_settings, img_client, first)
    assert np.array_equal(frames, reference(lambda s: img_pipe(s, image), first))
    record = wait_done(img_client, first)
    assert record.fields["resumed_from"] == str(first.first_step) == "2"
    # The image did something: the same request without it is another picture.
    assert not np.array_equal(frames, reference(img_pipe, dataclasses.replace(first,
                                                                                image=None)))

    # Another prompt, seed and strength on the same image at the same size: its encoding is
    # read, not computed again (the sample drawn from it is the seed's).
    second = edit(content_hash, 1.0, prompt="a small boat at sea", seed=3)
    frames = run_request(img_settings, img_client, second)
    assert np.array_equal(frames, reference(lambda s: img_pipe(s, image), second))
    kind = KeyKind.IMAGE_LATENT.value
    assert lookups(record).get(kind) == 1 and record.hits().get(kind, 0) == 0
    again = wait_done(img_client, second)
    assert lookups(again).get(kind) == 1 and again.hits().get(kind) == 1


def test_a_request_resumed_with_its_image_encoding_lost_gives_the_same_bytes(
        img_settings: Settings, img_client: redis.Redis, img_pipe: Callable[..., np.ndarray],
        img_pool: object, qwen_model_dir: Path) -> None:
    image = picture(2)
    content_hash = stored(img_settings, image)
    spec = edit(content_hash, 0.8, seed=21)  # starts at step 1 of 6
    frames = run_request(img_settings, img_client, spec)
    assert np.array_equal(frames, reference(lambda s: img_pipe(s, image), spec))
    record = wait_done(img_client, spec)
    assert min(record.checkpoints()) > spec.first_step  # none before the trajectory starts
    cache = open_cache(img_settings)
    try:
        rewind(img_settings, cache, record, 3)
        vae = qwen_image.image_encoder_fingerprint(qwen_model_dir, CPU)
        assert cache.remove(image_latent_key(TENANT, vae, content_hash, (64, 64, 1)))
    finally:
        cache.close()

    repeat = dataclasses.replace(spec, request_id=new_request_id())
    assert np.array_equal(run_request(img_settings, img_client, repeat), frames)
    resumed = wait_done(img_client, repeat)
    assert resumed.fields["resumed_from"] == "3"
    assert resumed.hits().get(KeyKind.IMAGE_LATENT.value, 0) == 0  # encoded again


@pytest.mark.parametrize("step_cache", [
    StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.3),
    StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1)],
    ids=lambda c: c.policy.value)
def test_a_step_cache_on_an_image_trajectory_is_the_pipelines_from_every_checkpoint(
        img_settings: Settings, img_client: redis.Redis, img_pipe: Callable[..., np.ndarray],
        img_pool: object, step_cache: StepCache) -> None:
    """The hooks start with the trajectory, at its first step, as the pipeline's do; their
    state travels in each checkpoint."""
    image = picture(6)
    content_hash = stored(img_settings, image)
    spec = edit(content_hash, 0.8, seed=41, num_inference_steps=8, step_cache=step_cache)
    assert spec.first_step == 1
    expected = reference(lambda s: img_pipe(s, image), spec)
    assert not np.array_equal(expected, reference(lambda s: img_pipe(s, image),
                                                  dataclasses.replace(spec,
                                                                      step_cache=StepCache())))
    assert np.array_equal(run_request(img_settings, img_client, spec), expected)
    record = wait_done(img_client, spec)
    assert record.counter("lookups:step") == 14  # every forward of the 7 guided steps run
    assert 0 < record.counter("hits:step") < 14
    cache = open_cache(img_settings)
    try:
        for k in range(7, spec.first_step, -1):
            rewind(img_settings, cache, record, k)
            again = dataclasses.replace(spec, request_id=new_request_id())
            frames = run_request(img_settings, img_client, again)
            assert wait_done(img_client, again).counter("resumed_from") == k
            assert np.array_equal(frames, expected), f"resumed from step {k}"
    finally:
        cache.close()


def test_an_image_request_parked_resumed_and_branched_is_exact(
        img_settings: Settings, img_client: redis.Redis, img_pipe: Callable[..., np.ndarray],
        img_pool: dict[Stage, list[ChildProcess]]) -> None:
    image = picture(5)
    content_hash = stored(img_settings, image)
    spec = edit(content_hash, 0.9, seed=33, num_inference_steps=60)  # starts at step 6
    submit(img_client, spec)
    # Asked while its worker is stopped three steps in, so the request cannot finish first.
    worker, _ = stop_owner_when(img_client, spec, Stage.DENOISE, img_pool[Stage.DENOISE],
                                lambda f: int(f.get("step", 0)) >= spec.first_step + 3)
    lifecycle = Lifecycle(img_client)
    try:
        assert lifecycle.ask_preempt(spec.tenant, spec.request_id, PreemptMode.PARK)
    finally:
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGCONT)
    wait_for(img_client, spec, State.PREEMPTED)
    parked = Records(img_client).get(spec.tenant, spec.request_id)
    assert parked is not None
    lifecycle.resume(parked)
    record = wait_done(img_client, spec)
    assert record.counter("preemptions") == 1
    assert record.counter("resumed_from") > spec.first_step
    assert np.array_equal(read_frames(img_settings, record),
                          reference(lambda s: img_pipe(s, image), spec))

    # An edit of the last steps branches from the checkpoint at its switch, and gives what the
    # branched request computes from scratch where nothing is shared (another tenant).
    tail = (PromptSegment("a small boat at sea", spec.schedule[0].negative_prompt, 60),)
    branch = spec.branch(new_request_id(), 30, tail)
    branched = run_request(img_settings, img_client, branch)
    assert wait_done(img_client, branch).counter("resumed_from") == 30
    elsewhere = dataclasses.replace(branch, request_id=new_request_id(), tenant=OTHER)
    stored(img_settings, image, tenant=OTHER)
    assert np.array_equal(run_request(img_settings, img_client, elsewhere), branched)
    assert wait_done(img_client, elsewhere).counter("resumed_from") == spec.first_step


def test_the_generate_route_takes_an_uploaded_image_and_names_what_it_refuses(
        img_settings: Settings, img_client: redis.Redis, img_pool: object,
        tmp_path: Path) -> None:
    png = io.BytesIO()
    picture(3).save(png, format="PNG")
    with serve_api(img_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        content_hash = uploaded(http, png.getvalue())
        body = {"prompt": "a red fox", "image": content_hash, "strength": 0.5, "width": 64,
                "height": 64, "num_inference_steps": 4, "seed": 5, "output_format": "npy"}
        accepted = http.post("/v1/generate", json=body)
        assert accepted.status_code == 202, accepted.text
        request_id = accepted.json()["id"]
        record = wait_until(
            lambda: (r := Records(img_client).get(img_settings.default_tenant, request_id))
            is not None and r.state.terminal and r, timeout_s=120, what="the request done")
        assert record.state is State.DONE, record
        assert record.spec.image == ImageInput(content_hash, 0.5)

        # The same picture inline is the same image, under the same hash.
        inline = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        accepted = http.post("/v1/generate", json=body | {"image": inline, "seed": 6})
        assert accepted.status_code == 202, accepted.text
        inlined = Records(img_client).get(img_settings.default_tenant, accepted.json()["id"])
        assert inlined is not None and inlined.spec.image == ImageInput(content_hash, 0.5)

        for change, field, status in [
            ({"image": "f" * 32}, "image", 404),
            # The cheap checks come first: no store work for a request refused anyway.
            ({"image": "f" * 32, "width": 40}, "width", 422),
            ({"image": "data:image/png;base64,AAA"}, "image", 422),  # not base64
            ({"image": "data:image/png;base64,bm90IGFuIGltYWdl"}, "image", 422),  # no image
            ({"step_cache": {"policy": "magcache"}}, "step_cache.policy", 422),
            ({"reuse": {"mode": "approximate"}}, "reuse.mode", 422),
        ]:
            refused = http.post("/v1/generate", json=body | change)
            assert refused.status_code == status, refused.text
            assert field in refused.text, refused.text

        # An image inline with a request that is refused is not kept.
        other = io.BytesIO()
        picture(30).save(other, format="PNG")
        data_url = "data:image/png;base64," + base64.b64encode(other.getvalue()).decode()
        refused = http.post("/v1/generate", json=body | {"image": data_url,  # checked last
                                                          "reuse": {"mode": "approximate"}})
        assert refused.status_code == 422, refused.text
        never_kept = normalise(other.getvalue(), 2**20, 2**20).hash
        assert http.get(f"/v1/images/{never_kept}").status_code == 404

        # The command line uploads a file and asks the same: the same request's output.
        photo, out = tmp_path / "fox.png", tmp_path / "edited.npy"
        photo.write_bytes(png.getvalue())
        ran = CliRunner().invoke(app, [
            "generate", "a red fox", "--image", str(photo), "--strength", "0.5", "--width",
            "64", "--height", "64", "--steps", "4", "--seed", "5", "--out", str(out)],
            env={"DIFFCACHE_API__PORT": url.rsplit(":", 1)[1],
                 "DIFFCACHE_DATA_DIR": str(tmp_path)})
        assert ran.exit_code == 0, ran.output
        assert np.array_equal(decode_npy(out.read_bytes()), read_frames(img_settings, record))


def test_openai_images_edit_from_the_official_client_is_the_same_image_to_image(
        img_settings: Settings, img_client: redis.Redis, img_pipe: Callable[..., np.ndarray],
        img_pool: object) -> None:
    image = picture(4)
    png = io.BytesIO()
    image.save(png, format="PNG")
    # Diffusion settings travel as the SDK sends extension fields: form fields beside its own.
    extension = {"seed": 9, "num_inference_steps": 4, "strength": 0.7, "size": "64x64"}
    with serve_api(img_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        wait_until(lambda: http.post("/v1/images", content=png.getvalue()).status_code == 201,
                   timeout_s=60, what="the API's store connected")
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = sdk.images.edit(image=("fox.png", png.getvalue(), "image/png"),
                                 prompt="a red fox", response_format="url",
                                 extra_body=extension)
        assert answer.data and answer.data[0].url
        record = answered_record(img_client, img_settings, answer.data[0].url)
        assert record.spec.image is not None
        assert (record.spec.image.strength, record.spec.seed) == (0.7, 9)
        kept = http.get(answer.data[0].url)
        assert kept.status_code == 200, kept.text
        pixels = iio.imread(kept.content, extension=".png")
        assert np.array_equal(pixels, reference(lambda s: img_pipe(s, image), record.spec)[0])

        # The same edit as base64, the image sent as a list (image[]): the same pixels.
        again = sdk.images.edit(image=[("fox.png", png.getvalue(), "image/png")],
                                prompt="a red fox", extra_body=extension)
        assert again.data and again.data[0].b64_json
        assert base64.b64decode(again.data[0].b64_json) == kept.content

        wrong_size = io.BytesIO()  # a mask is the image's size
        Image.new("L", (image.width + 16, image.height)).save(wrong_size, format="PNG")
        for call, field in [
            (dict(image=("fox.png", png.getvalue()), mask=("m.png", wrong_size.getvalue())),
             "mask"),
            (dict(image=[("a.png", png.getvalue()), ("b.png", png.getvalue())]), "image[]"),
            (dict(image=("fox.txt", b"not an image")), "image"),
            (dict(image=("fox.png", png.getvalue()), n=2), "n"),
        ]:
            with pytest.raises(openai.UnprocessableEntityError) as refused:
                sdk.images.edit(prompt="a red fox", extra_body=extension, **call)
            assert isinstance(refused.value.body, dict), refused.value
            assert refused.value.body["param"] == field, refused.value
