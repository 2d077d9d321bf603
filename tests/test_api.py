"""The REST API against the session stack and real worker processes."""

from __future__ import annotations

import ast
import base64
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from cachesvc.connect import open_cache
from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import GenerationSpec, StoreKey
from tests.workers_harness import in_hand, reference
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import State
from workers.stages.media import decode_npy

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4}


def app_client(settings: Settings, **api: object) -> TestClient:
    configured = settings.model_copy(update={"api": ApiSettings(**api)})  # type: ignore[arg-type]
    return TestClient(create_app(configured))


@pytest.fixture(scope="module")
def http(worker_settings: Settings, pool: object) -> Iterator[TestClient]:
    with app_client(worker_settings) as client:
        yield client


def wait_state(http: TestClient, request_id: str, timeout_s: float = 120,
               headers: dict[str, str] | None = None) -> dict[str, object]:
    """The request's status once it is DONE, FAILED or CANCELLED."""

    def finished() -> dict[str, object] | None:
        status: dict[str, object] = http.get(f"/v1/requests/{request_id}",
                                             headers=headers).json()
        return status if status["state"] in ("DONE", "FAILED", "CANCELLED") else None

    return wait_until(finished, timeout_s=timeout_s, interval_s=0.05,
                      what=f"request {request_id} finished")


def test_generate_events_and_result_match_the_pipeline(http: TestClient, pipe: object) -> None:
    body = {"prompt": "a red boat on the sea", "negative_prompt": "blurry", "seed": 5,
            "output_format": "npy", "guidance_scale": 4.0, **SMALL}
    accepted = http.post("/v1/generate", json=body)
    assert accepted.status_code == 202
    request_id = accepted.json()["id"]
    assert accepted.json()["result_url"] == f"/v1/requests/{request_id}/result"
    with http.stream("GET", f"/v1/requests/{request_id}/events") as events:
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    progress = [json.loads(line[6:]) for line in lines[:-1]]
    assert [p["step"] for p in progress] == sorted(p["step"] for p in progress)
    assert progress[-1]["state"] == "DONE" and json.loads(lines[-1][6:]) == {"state": "DONE"}
    result = http.get(f"/v1/requests/{request_id}/result")
    assert result.status_code == 200
    assert result.headers["content-type"] == "application/octet-stream"
    spec = GenerationSpec.create(request_id="ref", tenant="default", prompt=body["prompt"],
                                 negative_prompt="blurry", seed=5, guidance_scale=4.0,
                                 **SMALL)  # type: ignore[arg-type]
    assert np.array_equal(decode_npy(result.content), reference(pipe, spec))
    status = http.get(f"/v1/requests/{request_id}").json()
    assert set(status["stage_seconds"]) == {"encode", "denoise", "decode"}
    assert status["steps"] == 4 and status["error"] is None
    # Exact unless asked (or the tenant's default says otherwise), and said so on the result.
    assert status["reuse"] == {"mode": "exact", "approximate": False, "source_request_id": None,
                               "steps_reused": 0, "similarity": None, "effective_seed": 5}
    assert result.headers["X-Diffcache-Reuse"] == "exact"


@pytest.mark.parametrize("change, field, limit", [
    ({"width": 33}, "width", "multiple of 16"),
    ({"height": 4096}, "height", "to 1024"),
    ({"num_frames": 6}, "num_frames", "4k+1"),
    ({"num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
    ({"num_inference_steps": 500}, "num_inference_steps", "from 1 to 100"),
    ({"guidance_scale": -1}, "guidance_scale", "greater than or equal to 0"),
    ({"seed": -5}, "seed", "greater than or equal to 0"),
    ({"output_format": "gif"}, "output_format", "mp4"),
    ({"output_format": "png", "num_frames": 5}, "output_format", "num_frames=1"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"prompt": "a, " * 300}, "prompt", "511 tokens"),
    ({"colour": "red"}, "colour", "not permitted"),
    ({"schedule": [{"prompt": "a dog", "until_step": 4}]}, "prompt", "exactly one"),
    ({"prompt": None, "schedule": [{"prompt": "a", "until_step": 3},
                                   {"prompt": "b", "until_step": 2}]}, "schedule", "rise"),
    ({"prompt": None, "num_inference_steps": 8,
      "schedule": [{"prompt": "a", "until_step": 4}]}, "schedule", "num_inference_steps=8"),
    ({"cfg_cache": {"mode": "interval"}}, "cfg_cache.interval", "needs an interval"),
    ({"cfg_cache": {"mode": "exact", "interval": 3}}, "cfg_cache.interval", "interval mode"),
    ({"step_cache": {"policy": "teacache"}}, "step_cache.policy", "'first_block'"),
    ({"step_cache": {"policy": "first_block", "interval": 3}}, "step_cache.interval",
     "does not apply to policy first_block"),
    ({"step_cache": {"policy": "first_block", "threshold": 2}}, "step_cache.threshold",
     "less than or equal to 1"),
    ({"step_cache": {"policy": "taylorseer", "max_order": 9}}, "step_cache.max_order",
     "less than or equal to 4"),
    ({"step_cache": {"policy": "magcache"}}, "step_cache.policy",
     "cannot run on the served wan model"),
    ({"reuse": {"mode": "approximate", "min_similarity": 0}}, "reuse.min_similarity",
     "greater than 0"),
    ({"reuse": {"mode": "approximate", "min_similarity": 1.5}}, "reuse.min_similarity",
     "less than or equal to 1"),
    ({"reuse": {"mode": "approximate", "max_skip": 1}}, "reuse.max_skip", "less than 1"),
    ({"reuse": {"mode": "approximate", "max_skip": -0.1}}, "reuse.max_skip",
     "greater than or equal to 0"),
    ({"reuse": {"mode": "nearby"}}, "reuse.mode", "'approximate'"),
    ({"prompt": None, "schedule": [{"prompt": "a", "until_step": 4}],
      "num_inference_steps": 4, "reuse": {"mode": "approximate"}}, "reuse.mode",
     "cannot use it"),
    ({"image": "0" * 32}, "image", "takes no input image"),
    ({"image": "not-a-hash"}, "image", "should match pattern"),
    ({"strength": 0.5}, "strength", "give image too"),
    ({"strength": 0}, "strength", "greater than 0"),
])
def test_bad_input_names_the_field_and_its_limit(http: TestClient, change: dict[str, object],
                                                 field: str, limit: str) -> None:
    response = http.post("/v1/generate", json={"prompt": "a cat", **change})
    assert response.status_code == 422
    assert response.json()["field"] == field
    assert limit in response.json()["error"]


def test_unknown_ids_missing_results_and_large_bodies(http: TestClient) -> None:
    assert http.get("/v1/requests/nope").status_code == 404
    assert http.get("/v1/requests/nope/result").status_code == 404
    accepted = http.post("/v1/generate", json={"prompt": "a slow tree", "output_format": "npy",
                                               **{**SMALL, "num_inference_steps": 60}})
    early = http.get(f"/v1/requests/{accepted.json()['id']}/result")
    # The answer says which request, and the state it is in, which is not yet DONE.
    running = "|".join(s.value for s in State if not s.terminal)
    assert early.status_code == 409
    assert re.fullmatch(rf"request {accepted.json()['id']} is ({running})",
                        early.json()["error"]), early.json()
    huge = http.post("/v1/generate", content=b"{" + b" " * 70000 + b"}",
                     headers={"content-type": "application/json"})
    assert huge.status_code == 413
    wait_state(http, accepted.json()["id"])


def test_cancel_stops_the_request_at_a_step_boundary(http: TestClient,
                                                     client: redis.Redis) -> None:
    accepted = http.post("/v1/generate", json={"prompt": "a long river", "output_format": "npy",
                                               **{**SMALL, "num_inference_steps": 100}})
    request_id = accepted.json()["id"]
    wait_until(lambda: http.get(f"/v1/requests/{request_id}").json()["step"] >= 2,
               timeout_s=120, what="denoised two steps")
    cancelled = http.delete(f"/v1/requests/{request_id}")
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "CANCELLED"
    # The denoise worker lets go of the job (acknowledges it) once it has stopped: whatever
    # it was going to write, it has written.
    wait_until(lambda: not in_hand(client, Stage.DENOISE, request_id), timeout_s=60,
               what="the denoise worker done with the cancelled job")
    final = http.get(f"/v1/requests/{request_id}").json()
    assert final["state"] == "CANCELLED" and final["step"] < 100
    assert http.delete(f"/v1/requests/{request_id}").status_code == 409


def test_a_cancelled_request_resumes_from_its_checkpoint(http: TestClient,
                                                       pipe: object) -> None:
    body = {"prompt": "a long river", "negative_prompt": "dark", "seed": 8,
            "output_format": "npy", **{**SMALL, "num_inference_steps": 30}}
    request_id = http.post("/v1/generate", json=body).json()["id"]
    wait_until(lambda: http.get(f"/v1/requests/{request_id}").json()["step"] >= 5,
               timeout_s=120, what="denoised five steps")
    assert http.delete(f"/v1/requests/{request_id}").status_code == 202
    assert http.post("/v1/resume", json={"request_id": request_id,
                                         "from_step": 3}).json()["field"] == "from_step"
    def checkpointed_where_it_stopped() -> bool:  # at a step boundary, with its checkpoint
        status = http.get(f"/v1/requests/{request_id}").json()
        return bool(status["checkpoints"]) and max(status["checkpoints"]) == status["step"] >= 5

    wait_until(checkpointed_where_it_stopped, timeout_s=120,
               what="a checkpoint where the cancel stopped it")
    resumed = http.post("/v1/resume", json={"request_id": request_id})
    assert resumed.status_code == 202 and resumed.json()["id"] == request_id
    status = wait_state(http, request_id)
    assert status["state"] == "DONE" and status["resumed_from"] >= 5
    assert http.post("/v1/resume", json={"request_id": request_id}).status_code == 409
    spec = GenerationSpec.create(request_id="ref", tenant="default", prompt=body["prompt"],
                                 negative_prompt="dark", seed=8, guidance_scale=5.0,
                                 **{**SMALL, "num_inference_steps": 30})  # type: ignore[arg-type]
    result = http.get(f"/v1/requests/{request_id}/result")
    assert np.array_equal(decode_npy(result.content), reference(pipe, spec))


def test_edit_and_resume_branches_a_new_request(http: TestClient, worker_settings: Settings
                                                ) -> None:
    body = {"schedule": [{"prompt": "a red fox", "until_step": 2},
                         {"prompt": "a red fox in the snow", "until_step": 4}],
            "seed": 9, "output_format": "npy", **SMALL}
    base = http.post("/v1/generate", json=body).json()["id"]
    status = wait_state(http, base)
    assert status["state"] == "DONE" and status["checkpoints"] == [1, 2, 3, 4]
    edit = {"request_id": base, "from_step": 2,
            "overrides": {"prompt": "a white owl", "guidance_scale": 3.0}}
    branched = http.post("/v1/resume", json=edit)
    assert branched.status_code == 202 and branched.json()["id"] != base
    done = wait_state(http, branched.json()["id"])
    assert done["state"] == "DONE" and done["resumed_from"] == 2
    refused = [
        ({**edit, "overrides": {"seed": 3}}, 422, "overrides.seed"),
        ({**edit, "overrides": {"width": 64}}, 422, "overrides.width"),
        ({**edit, "from_step": 4}, 422, "from_step"),
        ({**edit, "overrides": {"schedule": [{"prompt": "x", "until_step": 2}]}}, 422,
         "overrides.schedule"),
        ({**edit, "request_id": "nope"}, 404, None),
    ]
    for change, code, field in refused:
        response = http.post("/v1/resume", json=change)
        assert response.status_code == code, (change, response.json())
        assert response.json().get("field") == field
    record = Records(open_redis(worker_settings)).get("default", base)
    assert record is not None
    cache = open_cache(worker_settings)
    try:  # the checkpoint at step 2 expires: a branch from it is gone
        cache.remove(StoreKey.parse(record.checkpoints()[2]))
    finally:
        cache.close()
    gone = http.post("/v1/resume", json=edit)
    assert gone.status_code == 410 and "expired" in gone.json()["error"]


def test_preempt_parks_a_denoising_request_until_resumed(http: TestClient) -> None:
    body = {"prompt": "a quiet harbour", "output_format": "npy",
            **{**SMALL, "num_inference_steps": 60}}
    request_id = http.post("/v1/generate", json=body).json()["id"]
    wait_until(lambda: http.get(f"/v1/requests/{request_id}").json()["step"] >= 3,
               timeout_s=120, what="denoised three steps")
    asked = http.post(f"/v1/requests/{request_id}/preempt", json={"mode": "park"})
    assert asked.status_code == 202
    wait_until(lambda: http.get(f"/v1/requests/{request_id}").json()["state"] == "PREEMPTED",
               timeout_s=120, what="parked")
    again = http.post(f"/v1/requests/{request_id}/preempt")
    assert again.status_code == 409 and "DENOISING" in again.json()["error"]
    assert http.post("/v1/resume", json={"request_id": request_id}).status_code == 202
    status = wait_state(http, request_id)
    assert status["state"] == "DONE" and status["preemptions"] == 1
    assert status["resumed_from"] >= 3


def test_idempotency_key_returns_the_first_request(http: TestClient) -> None:
    body = {"prompt": "a quiet city", "output_format": "npy", **SMALL}
    first = http.post("/v1/generate", json=body, headers={"Idempotency-Key": "k-123"})
    second = http.post("/v1/generate", json=body, headers={"Idempotency-Key": "k-123"})
    assert first.json()["id"] == second.json()["id"]
    wait_state(http, first.json()["id"])


def test_api_keys_map_to_isolated_tenants(worker_settings: Settings, pool: object) -> None:
    with app_client(worker_settings, api_keys={"key-a": "acme", "key-b": "globex"}) as http:
        assert http.post("/v1/generate", json={"prompt": "x"}).status_code == 401
        accepted = http.post("/v1/generate", json={"prompt": "a dog", "output_format": "npy",
                                                   **SMALL}, headers={"X-API-Key": "key-a"})
        request_id = accepted.json()["id"]
        assert http.get(f"/v1/requests/{request_id}",
                        headers={"Authorization": "Bearer key-b"}).status_code == 404
        done = wait_state(http, request_id, headers={"X-API-Key": "key-a"})
        assert done["state"] == "DONE"


def test_a_full_queue_answers_429_with_retry_after(worker_settings: Settings,
                                                   pool: object) -> None:
    with app_client(worker_settings, max_queue_depth=2) as http:
        body = {"prompt": "a busy road", "output_format": "npy",
                **{**SMALL, "num_inference_steps": 60}}
        codes = [http.post("/v1/generate", json=body) for _ in range(4)]
        refused = [r for r in codes if r.status_code == 429]
        assert refused and refused[0].headers["retry-after"] == "5"
        assert "max_queue_depth" in refused[0].json()["error"]
        for r in codes:
            if r.status_code == 202:
                wait_state(http, r.json()["id"])


def test_openai_images_and_sglang_videos(http: TestClient) -> None:
    image = http.post("/v1/images/generations", json={"prompt": "a yellow flower",
                                                      "size": "32x32",
                                                      "num_inference_steps": 3})
    assert image.status_code == 200, image.text
    png = iio.imread(io.BytesIO(base64.b64decode(image.json()["data"][0]["b64_json"])))
    assert png.shape == (32, 32, 3)
    # A URL answer is absolute, as OpenAI clients expect; another model is a 404 naming ours.
    linked = http.post("/v1/images/generations", json={
        "prompt": "a yellow flower", "size": "32x32", "num_inference_steps": 3,
        "model": "wan", "response_format": "url"})
    assert linked.status_code == 200, linked.text
    url = linked.json()["data"][0]["url"]
    assert url.startswith("http://") and url.endswith("/result")
    assert http.get(url).status_code == 200
    other = http.post("/v1/images/generations", json={"prompt": "a flower", "model": "dall-e-3"})
    assert other.status_code == 404 and "wan/" in other.json()["error"]["message"]
    # Half a second at 12 fps is 6 frames: Wan takes 4k + 1, so 5 (its published limits').
    job = http.post("/v1/videos", json={"prompt": "a horse running", "size": "32x32",
                                        "seconds": 0.5, "fps": 12,
                                        "num_inference_steps": 3}).json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress")
    wait_until(lambda: http.get(f"/v1/videos/{job['id']}").json()["status"] == "completed",
               timeout_s=120, interval_s=0.05, what=f"video job {job['id']} completed")
    video = http.get(f"/v1/videos/{job['id']}/content")
    assert video.headers["content-type"] == "video/mp4"
    assert iio.imread(video.content, extension=".mp4").shape == (5, 32, 32, 3)


def test_health_readiness_and_metrics(http: TestClient) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"]
    assert all(ready.json()["checks"].values())
    text = http.get("/metrics").text
    assert 'diffcache_cache_lookups_total{kind="embed",tenant="default"}' in text
    assert 'diffcache_cache_lookups_total{kind="cfg",tenant="default"}' in text
    assert 'diffcache_queue_depth{priority="batch",stage="denoise"}' in text
    # One histogram per stage and class, both classes exported whether or not they ran.
    for priority in ("interactive", "batch"):
        assert re.search(r'diffcache_stage_seconds_bucket\{(?=[^}]*le="\+Inf")'
                         rf'(?=[^}}]*priority="{priority}")(?=[^}}]*stage="denoise")', text)


def test_the_api_imports_no_model_code() -> None:
    code = ("import sys, api.app; "
            "print(sorted(m for m in ('diffusers', 'transformers', 'workers.families') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# The queue side's modules the API may import: the client, and the contract its calls speak
# (request records, messages, admission's errors and limits, the served model's types).
API_MAY_IMPORT = {"client", "cluster_view", "admission", "schema", "messages", "served_model",
                  "submit"}


def test_the_api_reads_the_queue_side_only_through_its_client() -> None:
    """No reader of queue state (streams, records, metrics hashes) and no ``read_*`` function
    is imported by ``api/`` or ``admission/``: what the API shows of the cluster comes through
    ``QueueClient``."""
    found: dict[str, set[str]] = {}
    root = Path(__file__).parent.parent
    for path in [*(root / "api").rglob("*.py"), *(root / "admission").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):  # ``import workers.queue.x``
                modules = {a.name for a in node.names if a.name.startswith("workers")}
                found.setdefault(path.name, set()).update(modules)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workers"):
                module = node.module or ""
                names = {a.name for a in node.names}
                found.setdefault(path.name, set()).update(
                    {module} | {f"{module}.{n}" for n in names if n.startswith("read")})
    imported = {m for modules in found.values() for m in modules}
    assert imported, "the API talks to the queue side: the walk found none of its imports"
    assert all(m.startswith("workers.queue.") for m in imported), found
    assert {m.removeprefix("workers.queue.").split(".")[0] for m in imported} <= API_MAY_IMPORT
    assert not any(m.rsplit(".", 1)[1].startswith("read") for m in imported), found
