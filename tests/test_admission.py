"""One front door: ``diffcache submit`` refuses what the API refuses, with the same error and
field; prompt tokens are counted with the tokenizer the workers published, exactly as the
model folder counts them, on a machine without that folder; and before any worker has
published its model, a request is told to come back (503) instead of being checked by a guess.

Uses the workerless stack, so nothing drains the queue these tests fill."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
from rich.console import Console

from admission.request import RequestAdmission
from cli.client import Ask, admitted, submit_and_wait
from config.settings import ApiSettings, ModelSettings, Settings
from keys import StepCachePolicy
from keys.names import active_requests
from tests.redis_databases import ADMISSION, emptied, on_database
from tests.test_api_hardening import error_body
from tests.workers_harness import publish_as_workers, serve_api
from workers.families import qwen_image
from workers.queue.admission import Admission, Limits, published_limits
from workers.queue.client import QueueClient

PROMPT = "a lighthouse at dusk"


def served_without_folder(workerless_stack: Settings, model_dir: Path,
                          tmp_path: Path) -> tuple[Settings, redis.Redis]:
    """An emptied database where ``model_dir`` is published as its workers would, and settings
    for an API or CLI on a machine that has no model folder at all."""
    workers = on_database(workerless_stack, ADMISSION).model_copy(update={
        "model": ModelSettings(dir=model_dir, preset="test")})
    client = emptied(workers)
    publish_as_workers(client, workers)
    elsewhere = workers.model_copy(update={
        "model": ModelSettings(dir=tmp_path / "no-model-here", preset="test")})
    assert not elsewhere.model_dir.exists()
    return elsewhere, client


@contextmanager
def front_doors(settings: Settings, api: ApiSettings) -> Iterator[tuple[httpx.Client, Settings]]:
    """The API under the deployment limits ``api``, and the settings of a CLI on another
    machine, which has the default limits: it must admit under those the API published."""
    assert settings.api == ApiSettings()
    with serve_api(settings, api) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http, settings


def refusal(settings: Settings, ask: Ask, tmp_path: Path) -> str:
    """What ``diffcache submit`` says when it refuses ``ask``."""
    with pytest.raises(SystemExit) as refused:
        submit_and_wait(settings, ask, "default", str(tmp_path / "out.npy"),
                        Console(file=io.StringIO()))
    return str(refused.value)


def test_the_cli_refuses_what_the_api_refuses_with_the_same_error(
        workerless_stack: Settings, model_dir: Path, tmp_path: Path) -> None:
    settings, client = served_without_folder(workerless_stack, model_dir, tmp_path)
    # Over the cost cap: 32x32 (4 patches) x 5 frames (2 latent) x 4 steps x 2 CFG = 64.
    small = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4}
    with front_doors(settings, ApiSettings(max_cost=63, max_queue_depth=1)) as (http, cli):
        api = error_body(http.post("/v1/generate", json={"prompt": PROMPT, **small}), 422)
        said = refusal(cli, Ask(PROMPT, width=32, height=32, num_frames=5, steps=4), tmp_path)
        assert api["field"] == "cost" and str(api["error"]).startswith("cost: ")
        assert f"refused: {api['error']}" in said, (api, said)
        # A wrong size names the same field in both.
        api = error_body(http.post("/v1/generate", json={"prompt": PROMPT, **small,
                                                          "width": 40}), 422)
        said = refusal(cli, Ask(PROMPT, width=40, height=32, num_frames=5, steps=4), tmp_path)
        assert api["field"] == "width" and f"refused: {api['error']}" in said, (api, said)
        # The wrong model: the OpenAI route's 404, and the CLI's --model.
        api = error_body(http.post("/v1/images/generations", json={
            "prompt": PROMPT, "model": "qwen-image/elsewhere"}), 404)
        said = refusal(cli, Ask(PROMPT, model="qwen-image/elsewhere"), tmp_path)
        assert str(api["error"]) in said, (api, said)
        # Bounds of the API's schema hold at the CLI too, naming the same field.
        api = error_body(http.post("/v1/generate", json={"prompt": PROMPT,
                                                          "guidance_scale": 31}), 422)
        said = refusal(cli, Ask(PROMPT, guidance_scale=31), tmp_path)
        assert api["field"] == "guidance_scale" and "refused: guidance_scale: " in said, said
    # Over the queue bound: one request is in, the next is refused by both.
    one = {"width": 32, "height": 32, "num_frames": 1, "num_inference_steps": 1,
           "output_format": "npy"}
    with front_doors(settings, ApiSettings(max_queue_depth=1)) as (http, cli):
        assert http.post("/v1/generate", json={"prompt": PROMPT, **one}).status_code == 202
        api = error_body(http.post("/v1/generate", json={"prompt": PROMPT, **one}), 429)
        said = refusal(cli, Ask(PROMPT, width=32, height=32, num_frames=1, steps=1), tmp_path)
        assert str(api["error"]) in said and "api.max_queue_depth=1" in said, (api, said)
    assert client.zcard(active_requests()) == 1  # the CLI queued nothing


def test_the_cli_refuses_a_request_without_the_image_an_editing_model_needs(
        workerless_stack: Settings, edit_model_dir: Path, tmp_path: Path) -> None:
    """``diffcache submit`` sends no image: for a model that takes one with every request it
    refuses, naming the field the API names, and queues nothing."""
    settings, client = served_without_folder(workerless_stack, edit_model_dir, tmp_path)
    with front_doors(settings, ApiSettings()) as (http, cli):
        api = error_body(http.post("/v1/generate", json={"prompt": "make it red"}), 422)
        said = refusal(cli, Ask("make it red"), tmp_path)
    assert api["field"] == "image" and "refused: image: " in said, (api, said)
    assert "generate --image" in said
    assert client.zcard(active_requests()) == 0


def test_tokens_are_counted_as_the_model_folder_counts_them_without_the_folder(
        workerless_stack: Settings, qwen_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    settings, client = served_without_folder(workerless_stack, qwen_model_dir, tmp_path)
    folder = AutoTokenizer.from_pretrained(qwen_model_dir / "tokenizer")

    def exact(text: str) -> int:
        return len(folder(text, add_special_tokens=False).input_ids)

    admission = Admission(client, settings.api)
    served = admission.served()
    assert served.limits == qwen_image.LIMITS  # the family's own, published by its workers
    count = admission.text_limits(served).count
    texts = [PROMPT, "Zürich, 東京 & naïve café — 3.14159!", "  spaced\tout\n lines ",
             "a" * 300, "xylophonic quizzical " * 40, ""]
    assert [count(t) for t in texts] == [exact(t) for t in texts]
    # A byte-level BPE splits rare words into many tokens: far under the limit in words,
    # over it in tokens, so a word count would have let it through.
    limit = served.limits.max_prompt_tokens
    long = " ".join(["xylophonic quizzically"] * 60)
    assert len(long.split()) < limit < exact(long)
    with serve_api(settings, ApiSettings()) as url:
        body = error_body(httpx.post(f"{url}/v1/generate", json={"prompt": long}), 422)
        assert body["field"] == "prompt" and f"got {exact(long)}" in str(body["error"])
        words = long.split()
        while exact(fits := " ".join(words)) > limit:
            words.pop()
        answer = httpx.post(f"{url}/v1/generate", json={"prompt": fits, "output_format": "npy"})
        assert answer.status_code == 202, answer.text


def test_before_any_worker_has_published_a_request_is_told_to_retry(
        workerless_stack: Settings, tmp_path: Path) -> None:
    settings = on_database(workerless_stack, ADMISSION)
    client = emptied(settings)
    with serve_api(settings, ApiSettings()) as url:
        answer = httpx.post(f"{url}/v1/generate", json={"prompt": PROMPT})
        assert "no worker has said which model it serves" in str(error_body(answer, 503)["error"])
        assert answer.headers["retry-after"]
    said = refusal(settings, Ask(PROMPT), tmp_path)
    assert "no worker has said which model it serves" in said
    assert client.zcard(active_requests()) == 0


def test_the_cli_admits_under_the_tenant_defaults_the_api_published(
        workerless_stack: Settings, model_dir: Path, tmp_path: Path) -> None:
    """A tenant's default step cache is the API's setting: ``diffcache submit`` on a machine
    whose own settings name none still applies it, as the API would."""
    settings, client = served_without_folder(workerless_stack, model_dir, tmp_path)
    api = ApiSettings(step_cache_defaults={"default": StepCachePolicy.FIRST_BLOCK})
    with front_doors(settings, api) as (http, cli):
        assert http.get("/v1/models").status_code == 200  # the API has published its limits
        queue = QueueClient(client, published_limits(client) or Limits.of(cli.api))
        spec = admitted(queue, RequestAdmission(cli.api, queue.admission),
                        Ask(PROMPT, width=32, height=32, num_frames=1, steps=1), "default",
                        str(tmp_path / "out.npy"))
    assert spec.step_cache.policy is StepCachePolicy.FIRST_BLOCK
    assert client.zcard(active_requests()) == 1
