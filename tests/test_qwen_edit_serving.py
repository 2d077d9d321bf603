"""Instruction editing (Qwen-Image-Edit) through the three workers: outputs bit-identical to
``QwenImageEditPipeline`` over the same components (one thread per op, CPU, float32, the test
preset's condition area of 128x128 pixels), batched beside other images' rows; each
instruction read with its image once, each image's condition encoded once; resumed with
both lost; under a step cache; OpenAI's ``images.edit`` from the official client; the
refusals, each naming the field."""

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
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import ApiSettings
from keys import (
    GenerationSpec,
    ImageInput,
    KeyKind,
    PromptSegment,
    StepCache,
    StepCachePolicy,
    image_embedding_key,
    image_latent_key,
)
from tests.test_engine import batched_forwards, offered_together
from tests.test_img2img import lookups, picture, stored
from tests.workers_harness import (
    ModelService,
    answered_record,
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
from workers.families import qwen_image_edit
from workers.families.base import CPU
from workers.queue.messages import Stage
from workers.queue.schema import State
from workers.queue.served_model import request_defaults
from workers.queue.submit import new_request_id

pytestmark = pytest.mark.slow
TENANT = "edit"


@pytest.fixture(scope="module")
def edits(tmp_path_factory: pytest.TempPathFactory,
          edit_model_dir: Path) -> Iterator[ModelService]:
    with model_service(tmp_path_factory.mktemp("edit"), edit_model_dir, "edit") as service:
        yield service


@pytest.fixture(scope="module")
def edit_pipe(edit_model_dir: Path) -> Callable[..., np.ndarray]:
    return qwen_image_edit.FAMILY.reference(edit_model_dir, CPU)


def edit(content_hash: str, **changes: object) -> GenerationSpec:
    fields: dict[str, object] = dict(tenant=TENANT, prompt="make the sky green", width=64,
                                     height=64, num_frames=1, num_inference_steps=4,
                                     guidance_scale=4.0, seed=7,
                                     image=ImageInput(content_hash, strength=None))
    return make_spec(**(fields | changes))


def expected(pipe: Callable[..., np.ndarray], image: Image.Image,
             spec: GenerationSpec) -> np.ndarray:
    return reference(lambda s: pipe(s, image), spec)


def test_an_edit_is_bit_identical_and_reads_its_image_once(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(31)
    content_hash = stored(edits.settings, image, TENANT)
    first = edit(content_hash)
    frames = run_request(edits.settings, edits.client, first)
    assert np.array_equal(frames, expected(edit_pipe, image, first))
    made = wait_done(edits.client, first)
    texts, condition = KeyKind.IMAGE_EMBEDDING.value, KeyKind.IMAGE_LATENT.value
    assert lookups(made).get(texts) == 2 and made.hits().get(texts, 0) == 0  # and negative
    assert lookups(made).get(condition) == 1 and made.hits().get(condition, 0) == 0

    # Another instruction on the same image: its condition and negative text are read.
    second = edit(content_hash, prompt="make the fox blue", seed=3)
    assert np.array_equal(run_request(edits.settings, edits.client, second),
                          expected(edit_pipe, image, second))
    again = wait_done(edits.client, second)
    assert again.hits().get(texts) == 1 and again.hits().get(condition) == 1

    # The same instruction on another image is another embedding, and another picture.
    other = picture(32)
    moved = edit(stored(edits.settings, other, TENANT))
    moved_frames = run_request(edits.settings, edits.client, moved)
    assert np.array_equal(moved_frames, expected(edit_pipe, other, moved))
    assert not np.array_equal(moved_frames, frames)
    assert wait_done(edits.client, moved).hits().get(texts, 0) == 0


def test_edits_offered_together_share_forwards_and_each_matches_the_pipeline(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(33)
    content_hash = stored(edits.settings, image, TENANT)
    specs = [edit(content_hash, prompt=prompt, seed=100 + i)
             for i, prompt in enumerate(["make it red", "make the sky darker", "add a cat"])]
    before = batched_forwards(edits.client)
    offered_together(edits.client, edits.pool[Stage.DENOISE][0], specs)
    records = [wait_done(edits.client, spec) for spec in specs]
    assert batched_forwards(edits.client) > before
    for record in records:
        assert record.state is State.DONE, record
        assert np.array_equal(read_frames(edits.settings, record),
                              expected(edit_pipe, image, record.spec))


def test_an_edit_resumed_with_its_encodings_lost_gives_the_same_bytes(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray],
        edit_model_dir: Path) -> None:
    image = picture(34)
    content_hash = stored(edits.settings, image, TENANT)
    spec = edit(content_hash, seed=21, num_inference_steps=6)
    frames = run_request(edits.settings, edits.client, spec)
    assert np.array_equal(frames, expected(edit_pipe, image, spec))
    record = wait_done(edits.client, spec)
    encoder = qwen_image_edit.EditTextEncoder(edit_model_dir)
    cache = open_cache(edits.settings)
    try:
        rewind(edits.settings, cache, record, 3)
        assert cache.remove(image_latent_key(
            TENANT, qwen_image_edit.condition_fingerprint(edit_model_dir, CPU), content_hash,
            None))
        assert spec.image is not None
        for text in (spec.schedule[0].prompt, spec.schedule[0].negative_prompt):
            assert cache.remove(image_embedding_key(TENANT, encoder.fingerprint,
                                                    encoder.tokenize(text).ids, spec.image))
    finally:
        cache.close()
    repeat = dataclasses.replace(spec, request_id=new_request_id())
    assert np.array_equal(run_request(edits.settings, edits.client, repeat), frames)
    resumed = wait_done(edits.client, repeat)
    assert resumed.fields["resumed_from"] == "3"
    for kind in (KeyKind.IMAGE_LATENT, KeyKind.IMAGE_EMBEDDING):  # made again
        assert resumed.hits().get(kind.value, 0) == 0


def test_an_edit_branched_to_another_instruction_is_what_it_computes_from_scratch(
        edits: ModelService) -> None:
    """Edit-and-resume: the last steps under another instruction (read with the same image)
    start from the checkpoint at the switch, and give what the branched request computes
    from step 0 where nothing is shared (another tenant)."""
    image = picture(38)
    spec = edit(stored(edits.settings, image, TENANT), seed=43, num_inference_steps=6)
    run_request(edits.settings, edits.client, spec)
    tail = (PromptSegment("make the sky purple", spec.schedule[0].negative_prompt, 6),)
    branch = spec.branch(new_request_id(), 3, tail)
    branched = run_request(edits.settings, edits.client, branch)
    assert wait_done(edits.client, branch).counter("resumed_from") == 3
    elsewhere = dataclasses.replace(branch, request_id=new_request_id(), tenant="elsewhere")
    stored(edits.settings, image, "elsewhere")
    assert np.array_equal(run_request(edits.settings, edits.client, elsewhere), branched)
    assert wait_done(edits.client, elsewhere).counter("resumed_from") == 0


def test_a_step_cache_on_an_edit_is_the_pipelines(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(36)
    cache = StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=1)
    spec = edit(stored(edits.settings, image, TENANT), seed=41, num_inference_steps=6,
                step_cache=cache)
    step_cache_is_the_pipelines(edits, lambda s: expected(edit_pipe, image, s), spec)


def test_openai_images_edit_edits_and_the_routes_name_what_they_refuse(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray]) -> None:
    image = picture(35)
    png = io.BytesIO()
    image.save(png, format="PNG")
    extension = {"seed": 9, "num_inference_steps": 3, "size": "64x64"}
    with serve_api(edits.settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        wait_until(lambda: http.post("/v1/images", content=png.getvalue()).status_code == 201,
                   timeout_s=60, what="the API's store connected")
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = sdk.images.edit(image=("photo.png", png.getvalue(), "image/png"),
                                 prompt="make the sky green", response_format="url",
                                 extra_body=extension)
        assert answer.data and answer.data[0].url
        record = answered_record(edits.client, edits.settings, answer.data[0].url)
        assert record.spec.image is not None
        assert record.spec.image.strength is None
        kept = http.get(answer.data[0].url)
        assert kept.status_code == 200, kept.text
        assert np.array_equal(iio.imread(kept.content, extension=".png"),
                              expected(edit_pipe, image, record.spec)[0])

        with pytest.raises(openai.UnprocessableEntityError) as refused:
            sdk.images.edit(image=("photo.png", png.getvalue()), prompt="make it red",
                            extra_body=extension | {"strength": 0.5})
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"] == "strength"
        body = {"prompt": "make it red", "width": 64, "height": 64, "num_inference_steps": 3}
        content_hash = record.spec.image.hash
        for changes, field in [({}, "image"), ({"image": content_hash, "strength": 0.5},
                                               "strength"),
                               ({"image": content_hash, "mask": content_hash}, "mask"),
                               ({"image": content_hash, "prompt": "a <|image_pad|>"},
                                "prompt")]:
            generate = http.post("/v1/generate", json=body | changes)
            assert generate.status_code == 422, generate.text
            assert generate.json()["field"] == field, generate.text


def test_an_edit_given_no_size_takes_its_images_aspect_as_the_pipeline_does(
        edits: ModelService, edit_pipe: Callable[..., np.ndarray]) -> None:
    """``QwenImageEditPipeline`` sizes an output left unsized as the condition: the input
    image's aspect at the condition area (here a 48x72 picture, so not the model's square
    default). Asked through the official client with ``size="auto"``; a size so made that
    the deployment does not serve is refused saying where it came from."""
    image = picture(37)
    png, wide = io.BytesIO(), io.BytesIO()
    image.save(png, format="PNG")
    Image.new("RGB", (200, 50), "teal").save(wide, format="PNG")
    with serve_api(edits.settings, ApiSettings(max_width=192)) as url, \
            httpx.Client(base_url=url) as http:
        wait_until(lambda: http.post("/v1/images", content=png.getvalue()).status_code == 201,
                   timeout_s=60, what="the API's store connected")
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = sdk.images.edit(image=("photo.png", png.getvalue(), "image/png"),
                                 prompt="make the sky green", size="auto",
                                 response_format="url",
                                 extra_body={"seed": 3, "num_inference_steps": 2})
        assert answer.data and answer.data[0].url
        kept = http.get(answer.data[0].url)
        assert kept.status_code == 200, kept.text
        inline = "data:image/png;base64," + base64.b64encode(wide.getvalue()).decode()
        refused = http.post("/v1/generate", json={"prompt": "make it red", "image": inline})
        assert refused.status_code == 422, refused.text
        assert refused.json()["field"] == "width" and "200x50 input image" in refused.text
    record = answered_record(edits.client, edits.settings, answer.data[0].url)
    width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(
        qwen_image_edit.SMALL_CONDITION["test"], image.width / image.height)
    assert (record.spec.width, record.spec.height) == (width, height)
    default = request_defaults(edits.settings.model, edits.settings.model_dir)
    assert (width, height) != (default.width, default.height)
    assert np.array_equal(iio.imread(kept.content, extension=".png"),
                          expected(edit_pipe, image, record.spec)[0])
