"""``/v1/adapters`` end to end: an upload is validated against the served denoiser's layers and
refused with the field that is wrong (pickles, bad shapes, too large), a request applies it by
name through the worker pool, and a tenant can neither see nor use another tenant's adapter."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save as save_safetensors

from api.app import create_app
from bench.lora import random_lora
from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings, child_environ
from keys import adapter_key
from supervision.processes import ChildProcess, free_port

pytestmark = pytest.mark.slow
KEYS = {"key-a": "adapters-a", "key-b": "adapters-b"}
A, B = {"X-API-Key": "key-a"}, {"X-API-Key": "key-b"}
SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4,
         "output_format": "npy", "seed": 5}


@pytest.fixture(scope="module")
def http(worker_settings: Settings, pool: object) -> Iterator[TestClient]:
    api = ApiSettings(api_keys=KEYS, max_adapter_bytes=4 * 2**20)
    with TestClient(create_app(worker_settings.model_copy(update={"api": api}))) as client:
        yield client


def upload(http: TestClient, name: str, data: bytes, headers: dict[str, str]) -> dict[str, object]:
    response = http.post(f"/v1/adapters?name={name}", content=data, headers=headers)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_an_adapter_is_uploaded_listed_used_and_kept_to_its_tenant(
        http: TestClient, model_dir: Path, worker_settings: Settings) -> None:
    info = upload(http, "ink", save_safetensors(random_lora(model_dir, seed=2)), A)
    assert info["rank"] == 4 and info["targets"] == 4  # two layers in each of two blocks
    assert [a["name"] for a in http.get("/v1/adapters", headers=A).json()] == ["ink"]
    assert http.get("/v1/adapters", headers=B).json() == []

    accepted = http.post("/v1/generate", headers=A, json={
        "prompt": "a heron", **SMALL, "loras": [{"name": "ink", "scale": 0.5}]}).json()
    status = http.get(f"/v1/requests/{accepted['id']}", headers=A).json()
    assert status["loras"] == [{"hash": info["hash"], "scale": 0.5}]
    # The SGLang-style route takes them as an extension field.
    video = http.post("/v1/videos", headers=A, json={
        "prompt": "a heron", "size": "32x32", "num_frames": 5, "num_inference_steps": 4,
        "loras": [{"hash": info["hash"]}]}).json()
    status = http.get(f"/v1/requests/{video['id']}", headers=A).json()
    assert status["loras"] == [{"hash": info["hash"], "scale": 1.0}]

    # The store loses it (evicted, or gone with a storage node): its file puts it back.
    cache = open_cache(worker_settings)
    try:
        assert cache.remove(adapter_key("adapters-a", str(info["hash"])))
        again = http.post("/v1/generate", headers=A, json={
            "prompt": "a heron", **SMALL, "loras": [{"name": "ink"}]}).json()
        assert cache.exists(adapter_key("adapters-a", str(info["hash"])))
    finally:
        cache.close()
    done = wait_until(lambda: (s := http.get(f"/v1/requests/{again['id']}", headers=A).json())
                      ["state"] in ("DONE", "FAILED") and s, timeout_s=120,
                      what="the request with a restored adapter finished")
    assert done["state"] == "DONE"

    # Another tenant can use it neither by name nor by hash, nor delete it.
    for lora in ({"name": "ink"}, {"hash": info["hash"]}):
        refused = http.post("/v1/generate", headers=B, json={"prompt": "a heron", **SMALL,
                                                            "loras": [lora]})
        assert refused.status_code == 404 and "loras[0]" in refused.json()["error"]
    assert http.delete("/v1/adapters/ink", headers=B).status_code == 404
    assert http.delete("/v1/adapters/ink", headers=A).status_code == 204
    assert http.get("/v1/adapters", headers=A).json() == []


def test_bad_uploads_are_refused_naming_what_is_wrong(http: TestClient,
                                                      model_dir: Path) -> None:
    pickled = io.BytesIO()
    torch.save(random_lora(model_dir, seed=3), pickled)
    refused = http.post("/v1/adapters?name=pickle", content=pickled.getvalue(), headers=A)
    assert refused.status_code == 422 and "safetensors" in refused.json()["error"]

    state = random_lora(model_dir, seed=3)
    first = sorted(k for k in state if k.endswith("lora_A.weight"))[0]
    state[first] = torch.zeros(4, 7)  # the layer takes more than 7 inputs
    refused = http.post("/v1/adapters?name=shape", content=save_safetensors(state), headers=A)
    module = first.removeprefix("transformer.").removesuffix(".lora_A.weight")
    assert refused.status_code == 422 and refused.json()["field"] == module

    unknown = {"transformer.blocks.9.nowhere.lora_A.weight": torch.zeros(4, 8),
               "transformer.blocks.9.nowhere.lora_B.weight": torch.zeros(8, 4)}
    refused = http.post("/v1/adapters?name=unknown", content=save_safetensors(unknown),
                        headers=A)
    assert refused.status_code == 422 and refused.json()["field"] == "blocks.9.nowhere"

    # Neither family's diffusers LoRA loader takes the text encoder: refused, naming the tensor.
    text = {"text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight":
            torch.zeros(4, 32), **random_lora(model_dir, seed=3)}
    refused = http.post("/v1/adapters?name=text", content=save_safetensors(text), headers=A)
    assert refused.status_code == 422 and refused.json()["field"].startswith("text_encoder.")
    assert "text encoder" in refused.json()["error"]

    too_big = http.post("/v1/adapters?name=big", content=b"\0" * (4 * 2**20 + 1), headers=A)
    assert too_big.status_code == 413 and "api.max_adapter_bytes" in too_big.json()["error"]
    assert http.post("/v1/adapters?name=bad/name", content=b"x", headers=A).status_code == 422


def test_the_api_process_uploads_and_serves_results_without_loading_torch(
        worker_settings: Settings, pool: object, model_dir: Path, tmp_path: Path) -> None:
    """``python -m api`` on its own: the readiness probe, an adapter upload and a result all
    pass through the store as bytes, and the process never maps a torch library."""
    port = free_port("127.0.0.1")
    settings = worker_settings.model_copy(update={
        "data_dir": tmp_path, "api": ApiSettings(port=port, api_keys=KEYS)})
    api = ChildProcess("api", [sys.executable, "-m", "api"], tmp_path / "api.log",
                       child_environ(settings))
    url = f"http://127.0.0.1:{port}"
    api.start()
    try:
        api.wait_healthy(lambda: ready(url), 120, "see the API log")
        with httpx.Client(base_url=url, headers=A, timeout=60) as http:
            data = save_safetensors(random_lora(model_dir, seed=3))
            added = http.post("/v1/adapters?name=quill", content=data)
            assert added.status_code == 201, added.text
            accepted = http.post("/v1/generate", json={
                "prompt": "a heron", **SMALL, "loras": [{"name": "quill", "scale": 0.5}]})
            assert accepted.status_code == 202, accepted.text
            status_url = f"/v1/requests/{accepted.json()['id']}"
            done = wait_until(lambda: (s := http.get(status_url).json())["state"]
                              in ("DONE", "FAILED") and s, timeout_s=120,
                              what="the request with an adapter the API uploaded finished")
            assert done["state"] == "DONE", done
            result = http.get(f"{status_url}/result")
            assert result.status_code == 200 and len(result.content) > 0
        assert api.pid is not None
        mapped = Path(f"/proc/{api.pid}/maps").read_text()
        assert "libtorch" not in mapped and "torch/lib" not in mapped
    finally:
        api.stop()


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
