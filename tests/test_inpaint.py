"""Inpainting on the Qwen-Image family through the three workers: outputs bit-identical to
``QwenImageInpaintPipeline`` over the same components (one thread per op, CPU, float32), also
when resumed from a checkpoint with the image's and the mask's encodings lost; the image's
encoding shared with image-to-image; the mask on the generate route, the command line and
OpenAI's ``images.edit`` (from the official client), and its refusals, each naming the
field."""

from __future__ import annotations

import base64
import dataclasses
import io
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
from keys import GenerationSpec, ImageInput, KeyKind, image_key, image_latent_key, image_mask_key
from supervision.processes import ChildProcess
from tests.test_img2img import lookups, picture, stored, uploaded
from tests.workers_harness import (
    answered_record,
    embedded_serving,
    make_spec,
    read_frames,
    reference,
    rewind,
    run_request,
    serve_api,
    wait_done,
    worker_pool,
)
from uploads.images import InputImage, normalise_mask
from workers.families import family_named, qwen_image
from workers.families.base import CPU
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.submit import new_request_id
from workers.stages.media import decode_npy

pytestmark = pytest.mark.slow
TENANT = "inpaint"


@pytest.fixture(scope="module")
def inpaint_settings(tmp_path_factory: pytest.TempPathFactory,
                     qwen_model_dir: Path) -> Iterator[Settings]:
    with embedded_serving(tmp_path_factory.mktemp("inpaint-stack"), qwen_model_dir) as settings:
        yield settings


@pytest.fixture(scope="module")
def inpaint_client(inpaint_settings: Settings) -> redis.Redis:
    return open_redis(inpaint_settings)


@pytest.fixture(scope="module")
def inpaint_pool(inpaint_settings: Settings, inpaint_client: redis.Redis,
                 tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[Stage, list[ChildProcess]]]:
    with worker_pool(inpaint_settings, inpaint_client,
                     tmp_path_factory.mktemp("inpaint-logs"), "inp") as workers:
        yield workers


@pytest.fixture(scope="module")
def inpaint_pipe(qwen_model_dir: Path) -> Callable[..., np.ndarray]:
    return family_named("qwen-image").reference(qwen_model_dir)


def mask_png(width: int = 48, height: int = 72, transparent: bool = False) -> bytes:
    """The left part repainted: white there on black, or (``transparent``) fully
    transparent there on an opaque picture, as OpenAI's clients mark it."""
    if transparent:
        pixels = np.zeros((height, width, 4), dtype=np.uint8)
        pixels[..., :3] = 90
        pixels[:, width // 3:, 3] = 255
        mask = Image.fromarray(pixels, "RGBA")
    else:
        grey = np.zeros((height, width), dtype=np.uint8)
        grey[:, :width // 3] = 255
        mask = Image.fromarray(grey, "L")
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return out.getvalue()


def kept_mask(data: bytes) -> tuple[InputImage, Image.Image]:
    """A mask as the API keeps it, and its pixels as the pipeline is given them."""
    kept = normalise_mask(data, 2**20, 2**20)
    with Image.open(io.BytesIO(kept.png)) as opened:
        return kept, opened.copy()


def stored_mask(settings: Settings, data: bytes) -> tuple[str, Image.Image]:
    kept, pixels = kept_mask(data)
    cache = open_cache(settings)
    try:
        cache.put(image_key(TENANT, kept.hash),
                  torch.frombuffer(bytearray(kept.png), dtype=torch.uint8))
    finally:
        cache.close()
    return kept.hash, pixels


def inpainting(content_hash: str, mask: str | None, strength: float,
               **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(tenant=TENANT, width=64, height=64, num_frames=1,
                                     num_inference_steps=6, guidance_scale=4.0, seed=7,
                                     image=ImageInput(content_hash, strength, mask))
    fields.update(changes)
    return make_spec(**fields)


def test_inpainting_is_bit_identical_and_keeps_what_the_mask_keeps(
        inpaint_settings: Settings, inpaint_client: redis.Redis,
        inpaint_pipe: Callable[..., np.ndarray], inpaint_pool: object) -> None:
    image = picture(11)
    content_hash = stored(inpaint_settings, image, tenant=TENANT)
    mask, mask_pixels = stored_mask(inpaint_settings, mask_png())

    def pipeline(spec: GenerationSpec) -> np.ndarray:
        return inpaint_pipe(spec, image, mask_pixels)

    first = inpainting(content_hash, mask, 0.6)
    frames = run_request(inpaint_settings, inpaint_client, first)
    assert np.array_equal(frames, reference(pipeline, first))
    # The mask did something: image-to-image of the same request is another picture.
    plain = dataclasses.replace(first, request_id=new_request_id(),
                                image=ImageInput(content_hash, 0.6))
    assert not np.array_equal(frames, run_request(inpaint_settings, inpaint_client, plain))

    # From pure noise, another seed and prompt: the same image's encoding and the same
    # mask are read, not computed again (the image's was made for the first request, and
    # image-to-image read it too).
    second = inpainting(content_hash, mask, 1.0, seed=3, prompt="a small boat at sea")
    assert np.array_equal(run_request(inpaint_settings, inpaint_client, second),
                          reference(pipeline, second))
    image_kind, mask_kind = KeyKind.IMAGE_LATENT.value, KeyKind.IMAGE_MASK.value
    made = wait_done(inpaint_client, first)
    for kind in (image_kind, mask_kind):
        assert lookups(made).get(kind) == 1 and made.hits().get(kind, 0) == 0
    shared = wait_done(inpaint_client, plain)
    assert lookups(shared).get(image_kind) == 1 and shared.hits().get(image_kind) == 1
    assert mask_kind not in lookups(shared)
    again = wait_done(inpaint_client, second)
    for kind in (image_kind, mask_kind):
        assert lookups(again).get(kind) == 1 and again.hits().get(kind) == 1


def test_an_inpainting_resumed_with_its_encodings_lost_gives_the_same_bytes(
        inpaint_settings: Settings, inpaint_client: redis.Redis,
        inpaint_pipe: Callable[..., np.ndarray], inpaint_pool: object,
        qwen_model_dir: Path) -> None:
    """A checkpoint holds the latents; what each later step keeps of the image (its sample
    and the noise) is drawn again from the seed, from encodings made again."""
    image = picture(12)
    content_hash = stored(inpaint_settings, image, tenant=TENANT)
    mask, mask_pixels = stored_mask(inpaint_settings, mask_png(transparent=True))
    spec = inpainting(content_hash, mask, 0.8, seed=21)  # starts at step 1 of 6
    frames = run_request(inpaint_settings, inpaint_client, spec)
    assert np.array_equal(frames,
                          reference(lambda s: inpaint_pipe(s, image, mask_pixels), spec))
    record = wait_done(inpaint_client, spec)
    cache = open_cache(inpaint_settings)
    try:
        rewind(inpaint_settings, cache, record, 3)
        assert cache.remove(image_latent_key(
            TENANT, qwen_image.image_encoder_fingerprint(qwen_model_dir, CPU), content_hash,
            (64, 64, 1)))
        assert cache.remove(image_mask_key(
            TENANT, qwen_image.mask_fingerprint(qwen_model_dir, CPU), mask, 64, 64))
    finally:
        cache.close()

    repeat = dataclasses.replace(spec, request_id=new_request_id())
    assert np.array_equal(run_request(inpaint_settings, inpaint_client, repeat), frames)
    resumed = wait_done(inpaint_client, repeat)
    assert resumed.fields["resumed_from"] == "3"
    for kind in (KeyKind.IMAGE_LATENT, KeyKind.IMAGE_MASK):  # both encoded again
        assert resumed.hits().get(kind.value, 0) == 0


def test_a_mask_on_the_generate_route_the_command_line_and_openai_images_edit(
        inpaint_settings: Settings, inpaint_client: redis.Redis,
        inpaint_pipe: Callable[..., np.ndarray], inpaint_pool: object,
        tmp_path: Path) -> None:
    image = picture(13)
    png = io.BytesIO()
    image.save(png, format="PNG")
    transparent = mask_png(transparent=True)
    kept, mask_pixels = kept_mask(transparent)
    with serve_api(inpaint_settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        content_hash = uploaded(http, png.getvalue())
        mask = http.post("/v1/images", content=transparent, params={"kind": "mask"})
        assert mask.status_code == 201 and mask.json()["hash"] == kept.hash, mask.text
        body = {"prompt": "a red fox", "image": content_hash, "mask": kept.hash,
                "strength": 0.7, "width": 64, "height": 64, "num_inference_steps": 4,
                "seed": 5, "output_format": "npy"}
        accepted = http.post("/v1/generate", json=body)
        assert accepted.status_code == 202, accepted.text
        request_id = accepted.json()["id"]
        record = wait_until(
            lambda: (r := Records(inpaint_client).get(inpaint_settings.default_tenant,
                                                      request_id))
            is not None and r.state.terminal and r, timeout_s=120, what="the request done")
        assert record.state is State.DONE, record
        assert record.spec.image == ImageInput(content_hash, 0.7, kept.hash)
        assert np.array_equal(read_frames(inpaint_settings, record),
                              reference(lambda s: inpaint_pipe(s, image, mask_pixels),
                                        record.spec))

        # The mask inline is the same mask under the same hash.
        inline = "data:image/png;base64," + base64.b64encode(transparent).decode()
        accepted = http.post("/v1/generate", json=body | {"mask": inline, "seed": 6})
        assert accepted.status_code == 202, accepted.text
        inlined = Records(inpaint_client).get(inpaint_settings.default_tenant,
                                              accepted.json()["id"])
        assert inlined is not None and inlined.spec.image is not None
        assert inlined.spec.image.mask == kept.hash

        small = "data:image/png;base64," + base64.b64encode(mask_png(32, 32)).decode()
        without = {k: v for k, v in body.items() if k not in ("image", "strength")}
        for change, field, status in [
            ({"mask": small}, "mask", 422),  # not the image's size
            ({"mask": "e" * 32}, "mask", 404),
            ({"mask": "data:image/png;base64,bm90IGFuIGltYWdl"}, "mask", 422),
        ]:
            refused = http.post("/v1/generate", json=body | change)
            assert refused.status_code == status, refused.text
            assert field in refused.text, refused.text
        refused = http.post("/v1/generate", json=without)
        assert refused.status_code == 422 and "mask" in refused.text, refused.text

        # The command line uploads both files and asks the same: the same output.
        photo, cut, out = tmp_path / "fox.png", tmp_path / "mask.png", tmp_path / "out.npy"
        photo.write_bytes(png.getvalue())
        cut.write_bytes(transparent)
        ran = CliRunner().invoke(app, [
            "generate", "a red fox", "--image", str(photo), "--mask", str(cut), "--strength",
            "0.7", "--width", "64", "--height", "64", "--steps", "4", "--seed", "5", "--out",
            str(out)], env={"DIFFCACHE_API__PORT": url.rsplit(":", 1)[1],
                            "DIFFCACHE_DATA_DIR": str(tmp_path)})
        assert ran.exit_code == 0, ran.output
        assert np.array_equal(decode_npy(out.read_bytes()), read_frames(inpaint_settings, record))

        # OpenAI's client sends the mask as a file beside the image.
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        extension = {"seed": 9, "num_inference_steps": 4, "strength": 0.7, "size": "64x64"}
        answer = sdk.images.edit(image=("fox.png", png.getvalue(), "image/png"),
                                 mask=("mask.png", transparent, "image/png"),
                                 prompt="a red fox", response_format="url",
                                 extra_body=extension)
        assert answer.data and answer.data[0].url
        edited = answered_record(inpaint_client, inpaint_settings, answer.data[0].url)
        assert edited.spec.image is not None
        assert edited.spec.image == ImageInput(content_hash, 0.7, kept.hash)
        pixels = iio.imread(http.get(answer.data[0].url).content, extension=".png")
        assert np.array_equal(pixels, reference(lambda s: inpaint_pipe(s, image, mask_pixels),
                                                edited.spec)[0])
        with pytest.raises(openai.UnprocessableEntityError) as wrong:
            sdk.images.edit(image=("fox.png", png.getvalue(), "image/png"),
                            mask=("mask.png", mask_png(32, 32), "image/png"),
                            prompt="a red fox", extra_body=extension)
        assert isinstance(wrong.value.body, dict) and wrong.value.body["param"] == "mask"
