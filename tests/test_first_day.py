"""What a new user meets on the first day: a cost that knows the shipped model's geometry, a
synchronous OpenAI call whose client goes away cancels its request and whose retry joins it,
the official SDK reads our models and our errors, the CLI's client commands load no torch, an
output format is what its file says, and a read whose store lease expired is read again."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from cachesvc.mooncake_store import LEASE_EXPIRED, MooncakeStore, StoreEndpoints
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import ImageInput
from keys.names import request_index, stage_stream
from tests.redis_databases import FIRST_DAY, emptied, on_database
from tests.workers_harness import make_spec, serve_api, worker_named
from workers.families import qwen_image
from workers.families.base import tokenizer_json
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.queue.served_model import (
    ServedModel,
    model_card,
    publish_served,
    request_defaults,
)

SHIPPED = Path(qwen_image.__file__).parent / "trained" / "shapes"


def shipped_model() -> ServedModel:
    """The shipped shapes model as its workers publish it."""
    from config.settings import ModelSettings

    return ServedModel("qwen-image", SHIPPED.name, qwen_image.LIMITS,
                       request_defaults(ModelSettings(), SHIPPED),
                       qwen_image.geometry(SHIPPED), model_card(SHIPPED))


@pytest.fixture
def shapes_api(workerless_stack: Settings) -> Iterator[tuple[str, redis.Redis]]:
    """An API over a database where the shipped model is published as served; no workers."""
    settings = on_database(workerless_stack, FIRST_DAY)
    client = emptied(settings)
    publish_served(client, shipped_model(), tokenizer_json(SHIPPED))
    with serve_api(settings, ApiSettings(enforce_model_max=False)) as url:
        yield url, client


def test_the_shipped_models_cost_comes_from_its_geometry(
        shapes_api: tuple[str, redis.Redis]) -> None:
    model = shipped_model()
    assert model.geometry is not None and model.geometry.spatial_factor == 8  # VAE x4, patch 2
    big = make_spec(width=1024, height=1024, num_frames=1, num_inference_steps=20)
    assert model.cost(big) == (1024 // 8) ** 2 * 20 * 2 > ApiSettings().interactive_max_cost
    # Image-to-image runs the steps its strength leaves: 0.25 of 20 starts at step 15.
    edit = dataclasses.replace(big, image=ImageInput("0" * 32, strength=0.25))
    assert model.cost(edit) == (1024 // 8) ** 2 * 5 * 2
    url, client = shapes_api
    answer = httpx.post(f"{url}/v1/generate", json={"prompt": "a red circle", "width": 1024,
                                                    "height": 1024, "num_inference_steps": 20},
                        timeout=30)
    assert answer.status_code == 202, answer.text
    record = Records(client).get("default", answer.json()["id"])
    assert record is not None and record.spec.priority.value == "batch"  # demoted
    assert any("trained at 32x32" in w for w in answer.json()["warnings"])
    # The size rule is the model's own: a multiple of 8, not of 16.
    small = httpx.post(f"{url}/v1/generate", json={"prompt": "a red circle", "width": 40,
                                                   "height": 40}, timeout=30)
    assert small.status_code == 202, small.text


def test_above_the_model_cards_maximum_is_a_422_naming_the_field(
        workerless_stack: Settings) -> None:
    settings = on_database(workerless_stack, FIRST_DAY)
    publish_served(emptied(settings), shipped_model(), tokenizer_json(SHIPPED))
    with serve_api(settings, ApiSettings()) as url:
        answer = httpx.post(f"{url}/v1/generate", json={"prompt": "a red circle",
                                                        "width": 1024, "height": 32})
        assert answer.status_code == 422 and answer.json()["field"] == "width"
        assert "at most 256" in answer.json()["error"]
        words = httpx.post(f"{url}/v1/generate", json={"prompt": "a cat on a sofa"}).json()
        assert any("never saw: cat, sofa" in w for w in words["warnings"]), words


def test_the_official_sdk_lists_the_model_and_shows_our_errors(
        shapes_api: tuple[str, redis.Redis]) -> None:
    url, _ = shapes_api
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    (listed,) = sdk.models.list().data
    assert listed.id == "qwen-image/shapes"
    assert sdk.models.retrieve("qwen-image/shapes").id == listed.id
    defaults = (listed.model_extra or {})["diffcache"]["defaults"]
    assert isinstance(defaults["width"], int) and isinstance(defaults["guidance_scale"], float)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        sdk.images.generate(model="dall-e-3", prompt="a red circle")
    with pytest.raises(openai.UnprocessableEntityError, match="width: must be a multiple of 8"):
        sdk.images.generate(prompt="a red circle", size="33x33")  # type: ignore[arg-type]


def post_and_leave(url: str, body: bytes) -> socket.socket:
    """Send a synchronous images call and leave it waiting; closing the socket abandons it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


@pytest.mark.slow
def test_an_abandoned_call_is_cancelled_and_its_retry_joins_it(
        worker_settings: Settings, client: redis.Redis, pool: dict[Stage, Any]) -> None:
    with serve_api(worker_settings, ApiSettings()) as url:
        earlier = set(client.zrange(request_index("default"), 0, -1))
        records = Records(client)

        def accepted(prompt: str) -> list[str]:
            # The calls' own requests, told by their prompt: not merely the newest in the
            # index, which another test's late request could be.
            new = set(client.zrange(request_index("default"), 0, -1)) - earlier
            return [m.decode() for m in new
                    if (r := records.get("default", m.decode())) is not None
                    and r.spec.schedule[0].prompt == prompt]

        body = (b'{"prompt": "a lighthouse at dawn", "size": "64x64", "seed": 41, '
                b'"num_inference_steps": 100}')
        sock = post_and_leave(url, body)
        newest = wait_until(lambda: next(iter(accepted("a lighthouse at dawn")), None),
                            timeout_s=30, interval_s=0.02, what="the call's request accepted")

        def denoising() -> bool:
            record = records.get("default", newest)
            assert record is not None and not record.state.terminal, record
            return record.state is State.DENOISING and record.step >= 1

        wait_until(denoising, timeout_s=60, interval_s=0.01, what="the call's request denoising")
        owner = worker_named(pool[Stage.DENOISE], records.get("default", newest)
                             .fields["worker:denoise"])  # type: ignore[union-attr]
        assert owner.pid is not None
        os.kill(owner.pid, signal.SIGSTOP)  # so the client surely leaves before it is done
        try:
            sock.close()
            wait_until(lambda: (r := records.get("default", newest)) is not None
                       and r.state is State.CANCELLED, timeout_s=30, interval_s=0.05,
                       what="the abandoned call's request cancelled")
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        # The SDK's retry of the same body joins that request, resumed, and gets its image.
        retry = httpx.post(f"{url}/v1/images/generations", content=body, timeout=300,
                           headers={"Content-Type": "application/json",
                                    "X-Stainless-Retry-Count": "1"})
        assert retry.status_code == 200, retry.text
        assert base64.b64decode(retry.json()["data"][0]["b64_json"])[:4] == b"\x89PNG"
        record = records.get("default", newest)
        assert record is not None and record.state is State.DONE
        assert record.counter("resumes") == 1
        assert accepted("a lighthouse at dawn") == [newest]  # one job, not two
        # Two calls with one Idempotency-Key make one job too.
        keyed = b'{"prompt": "a green train at night", "size": "32x32", "seed": 42}'
        answers: list[httpx.Response] = []

        def call() -> None:
            answers.append(httpx.post(f"{url}/v1/images/generations", content=keyed,
                                      timeout=300, headers={"Content-Type": "application/json",
                                                            "Idempotency-Key": "first-day"}))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["data"] == answers[1].json()["data"]
        assert len(accepted("a green train at night")) == 1


def run_cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``diffcache <args>`` in a fresh interpreter that reports whether torch was loaded."""
    code = ("import sys\nfrom cli.main import app\ntry:\n    app(sys.argv[1:])\n"
            "except SystemExit as exc:\n    print('exit', exc.code)\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCACHE_")}
    env.update(DIFFCACHE_DATA_DIR=str(tmp_path), DIFFCACHE_API__PORT="1")  # nothing there
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


@pytest.mark.parametrize("args", [["--help"], ["status"], ["generate", "--help"],
                                  ["generate", "a red circle", "--out", "x.png"]])
def test_the_client_commands_load_no_torch(args: list[str], tmp_path: Path) -> None:
    done = run_cli(args, tmp_path)
    assert done.stdout.strip().endswith("no torch"), done.stdout + done.stderr


def test_an_output_file_the_server_cannot_write_is_refused_before_submitting(
        tmp_path: Path) -> None:
    for out, said in ((tmp_path / "x.jpg", "does not write"),
                      (tmp_path / "x", "has no extension"),
                      (tmp_path / "missing" / "x.png", "is not a directory")):
        done = run_cli(["generate", "a red circle", "--out", str(out)], tmp_path)
        assert said in done.stdout + done.stderr, done.stdout + done.stderr
        assert "no API" not in done.stdout + done.stderr  # refused before any call


def test_submit_writes_no_mp4_for_an_image_model(workerless_stack: Settings,
                                                 tmp_path: Path) -> None:
    from rich.console import Console

    from cli.client import Ask, submit_and_wait

    settings = on_database(workerless_stack, FIRST_DAY)
    client = emptied(settings)
    publish_served(client, shipped_model(), tokenizer_json(SHIPPED))
    quiet = Console(file=io.StringIO())
    with pytest.raises(SystemExit, match="makes images, not video"):
        submit_and_wait(settings, Ask("a red circle"), "default", str(tmp_path / "s.mp4"),
                        quiet)
    with pytest.raises(SystemExit, match="makes images, not video"):
        submit_and_wait(settings, Ask("a red circle", output_format="mp4"), "default",
                        str(tmp_path / "s"), quiet)
    assert client.xlen(stage_stream(Stage.ENCODE.value, "interactive")) == 0  # nothing queued


class ScriptedClient:
    """Mooncake's client as far as a read goes, answering the codes it is given in turn: the
    code table's handling of each, which a live store cannot be made to return on cue."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.calls = 0

    def get_into(self, key: str, ptr: int, capacity: int) -> int:
        self.calls += 1
        return self.codes.pop(0)

    def batch_get_into(self, keys: list[str], ptrs: list[int], caps: list[int]) -> list[int]:
        return [self.get_into(k, p, c) for k, p, c in zip(keys, ptrs, caps, strict=True)]


def test_a_read_whose_lease_expired_is_read_again_then_counts_as_a_miss() -> None:
    endpoints = StoreEndpoints("127.0.0.1:1", "http://127.0.0.1:1/metadata")
    again = ScriptedClient([LEASE_EXPIRED, 64])
    assert MooncakeStore(again, endpoints).get_into("k", 0, 64) == 64
    assert again.calls == 2
    stuck = ScriptedClient([LEASE_EXPIRED] * 4)
    assert MooncakeStore(stuck, endpoints).get_into("k", 0, 64) is None  # a miss, no failure
    batch = ScriptedClient([64, LEASE_EXPIRED, 32])
    assert MooncakeStore(batch, endpoints).batch_get_into(["a", "b"], [0, 0],
                                                          [64, 64]) == [64, 32]
