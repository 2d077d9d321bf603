"""The API under hostile or broken conditions, over real servers: tenants isolated by key,
admission bounds that hold under concurrency, one error body for every failure, a body limit
that holds for chunked bodies, and 503s when Redis or the store is gone.

Uses the workerless stack, so nothing drains the queues these tests fill."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from api.errors import OPENAI_PREFIXES
from api.metrics import hashed_tenant, tenant_labeller
from cachesvc.counters import CacheCounters, Event
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, ModelSettings, Settings, load_settings
from keys import KeyKind, StoreKey
from keys.names import active_requests, request_record, stage_stream
from supervision.processes import free_port
from supervision.stack import EmbeddedStack
from tests.conftest import TEST_MODEL
from tests.redis_databases import API_HARDENING, emptied, on_database
from tests.workers_harness import publish_as_workers, serve_api

BODY = {"prompt": "a lighthouse at dusk", "output_format": "npy", "width": 32, "height": 32,
        "num_frames": 5, "num_inference_steps": 4}
KEYS = {"key-a": "acme", "key-b": "globex"}
A, B, ADMIN = {"X-API-Key": "key-a"}, {"Authorization": "Bearer key-b"}, {"X-API-Key": "root"}


@pytest.fixture(scope="module")
def api_stack(workerless_stack: Settings, model_dir: Path) -> Settings:
    """The workerless stack, with a Redis database that only this module uses, serving the
    tiny test model."""
    return on_database(workerless_stack, API_HARDENING).model_copy(update={
        "model": ModelSettings(dir=model_dir, preset="test")})


@pytest.fixture
def quiet(api_stack: Settings) -> redis.Redis:
    """This module's Redis database, emptied (no request of another test counts as active),
    with the served model published as its workers would."""
    client = emptied(api_stack)
    publish_as_workers(client, api_stack)
    return client


@pytest.fixture
def keyed(api_stack: Settings, quiet: redis.Redis) -> Iterator[httpx.Client]:
    api = ApiSettings(api_keys=KEYS, admin_keys=["root"], max_jobs_per_tenant=3)
    with serve_api(api_stack, api) as url, httpx.Client(base_url=url) as http:
        yield http


def error_body(response: httpx.Response, status: int) -> dict[str, object]:
    """The documented error body of ``response``, after checking its status, as
    ``{"error", "field"}``: native routes answer that; the OpenAI-style ones answer
    ``{"error": {"message", "type", "param", "code"}}``, which is read into the same form."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body: dict[str, object] = response.json()
    if response.request.url.path.startswith(OPENAI_PREFIXES):
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
        assert set(body) == {"error"}
        body = {"error": error["message"], "field": error["param"]}
    assert isinstance(body["error"], str) and body["error"]
    assert set(body) <= {"error", "field"}
    return body


def test_a_tenant_request_is_invisible_without_its_key(keyed: httpx.Client) -> None:
    mine = keyed.post("/v1/generate", json=BODY, headers=A)
    assert mine.status_code == 202
    request_id = mine.json()["id"]
    path = f"/v1/requests/{request_id}"
    routes = [("GET", path), ("GET", f"{path}/result"), ("GET", f"{path}/events"),
              ("DELETE", path), ("POST", f"{path}/preempt"), ("GET", f"/v1/videos/{request_id}")]
    for method, path in routes:
        assert "API key" in str(error_body(keyed.request(method, path), 401)["error"])
        assert request_id in str(error_body(keyed.request(method, path, headers=B), 404)["error"])
        # An admin key reads dashboards; it is no tenant, so it reaches no request either.
        error_body(keyed.request(method, path, headers=ADMIN), 403)
    error_body(keyed.post("/v1/resume", json={"request_id": request_id}, headers=B), 404)
    error_body(keyed.post("/v1/generate", json=BODY, headers=ADMIN), 403)
    error_body(keyed.post("/v1/generate", json=BODY, headers={"X-API-Key": "key-z"}), 401)
    # Its owner still sees it, and nobody else's attempts changed it.
    assert keyed.get(f"/v1/requests/{request_id}", headers=A).json()["state"] == "QUEUED"
    assert keyed.delete(f"/v1/requests/{request_id}", headers=A).json()["state"] == "CANCELLED"


def test_dashboards_show_the_callers_tenant_and_admins_see_all(
        keyed: httpx.Client, quiet: redis.Redis) -> None:
    ids = {who: keyed.post("/v1/generate", json=BODY, headers=headers).json()["id"]
           for who, headers in (("acme", A), ("globex", B))}
    # Real counters, as a worker's cache writes them: acme's one lookup missed, globex's hit.
    counters = CacheCounters(quiet, flush_interval_s=3600)
    counters.add_many("acme", KeyKind.EMBEDDING, {Event.LOOKUPS: 1, Event.MISSES: 1})
    counters.add_many("globex", KeyKind.EMBEDDING, {Event.LOOKUPS: 1, Event.HITS: 1,
                                                    Event.COMPUTE_SECONDS_SAVED: 2.5})
    counters.close()

    def view(headers: dict[str, str]) -> tuple[set[str], set[str], list[str], list[float]]:
        data = keyed.get("/v1/dashboard", headers=headers).json()
        rows = {r["id"] for r in data["recent"]}
        reuse = [r["tenant"] for r in data["reuse"] if r["lookups"]]
        rates = [v for v in data["hit_rate"]["embed"] if v is not None]
        return rows, {r["tenant"] for r in data["recent"]}, reuse, rates

    rows, tenants, reuse, rates = view(A)
    assert ids["acme"] in rows and ids["globex"] not in rows
    assert tenants == {"acme"} and reuse == ["acme"] and rates == [0.0]
    rows, tenants, reuse, rates = view(B)
    assert ids["globex"] in rows and ids["acme"] not in rows
    assert tenants == {"globex"} and reuse == ["globex"] and rates == [1.0]
    rows, tenants, reuse, rates = view(ADMIN)
    assert {ids["acme"], ids["globex"]} <= rows and tenants == {"acme", "globex"}
    assert sorted(reuse) == ["acme", "globex"]
    # Both tenants summed: one hit in two lookups, unless a minute began between the two.
    assert rates == [0.5] or sorted(rates) == [0.0, 1.0]
    error_body(keyed.get("/v1/dashboard"), 401)
    error_body(keyed.get("/v1/dashboard", headers={"X-API-Key": "key-z"}), 401)
    assert keyed.get("/dashboard").status_code == 200  # the page itself holds no data

    # /metrics needs no key, so with keys configured it names no tenant.
    text = keyed.get("/metrics").text
    assert f'tenant="{hashed_tenant("globex")}"' in text
    assert 'tenant="globex"' not in text and 'tenant="acme"' not in text
    assert hashed_tenant("globex") == hashed_tenant("globex") != hashed_tenant("acme")


def test_metrics_tenant_labels_follow_the_setting() -> None:
    assert tenant_labeller(ApiSettings())("acme") == "acme"
    assert tenant_labeller(ApiSettings(api_keys=KEYS))("acme") == hashed_tenant("acme")
    assert tenant_labeller(ApiSettings(api_keys=KEYS,
                                       metrics_tenant_labels="plain"))("acme") == "acme"
    assert tenant_labeller(ApiSettings(metrics_tenant_labels="hashed"))("acme").startswith("t-")
    with pytest.raises(ValueError, match="admin key must map to no tenant"):
        ApiSettings(api_keys=KEYS, admin_keys=["key-a"])


def test_one_tenant_at_its_bound_gets_429_and_others_do_not(keyed: httpx.Client) -> None:
    first = [keyed.post("/v1/generate", json=BODY, headers=A).json()["id"] for _ in range(3)]
    over = keyed.post("/v1/generate", json=BODY, headers={**A, "Idempotency-Key": "once"})
    assert "api.max_jobs_per_tenant=3" in str(error_body(over, 429)["error"])
    assert over.headers["retry-after"] == "5"
    compat = keyed.post("/v1/videos", json={"prompt": "a boat", "size": "32x32"}, headers=A)
    assert "max_jobs_per_tenant" in str(error_body(compat, 429)["error"])
    assert keyed.post("/v1/generate", json=BODY, headers=B).status_code == 202  # globex is free

    # A finished request stops counting; the refused idempotency key was not kept.
    assert keyed.delete(f"/v1/requests/{first[0]}", headers=A).status_code == 202
    retried = keyed.post("/v1/generate", json=BODY, headers={**A, "Idempotency-Key": "once"})
    assert retried.status_code == 202 and retried.json()["id"] not in first
    # Resuming re-admits: refused at the bound, counted again once resumed.
    error_body(keyed.post("/v1/resume", json={"request_id": first[0]}, headers=A), 429)
    assert keyed.delete(f"/v1/requests/{first[1]}", headers=A).status_code == 202
    assert keyed.post("/v1/resume", json={"request_id": first[0]}, headers=A).status_code == 202
    error_body(keyed.post("/v1/generate", json=BODY, headers=A), 429)


def test_concurrent_submits_never_overshoot_the_queue_bound(api_stack: Settings,
                                                            quiet: redis.Redis) -> None:
    start = threading.Barrier(40)

    def post(url: str) -> int:
        with httpx.Client(base_url=url, timeout=60) as http:
            start.wait(timeout=30)
            return http.post("/v1/generate", json=BODY).status_code

    with serve_api(api_stack, ApiSettings(max_queue_depth=16)) as url, \
            ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(post, [url] * 40))
    assert codes.count(202) == 16 and codes.count(429) == 24, codes
    assert quiet.zcard(active_requests()) == 16
    assert quiet.xlen(stage_stream("encode", "interactive")) == 16


def test_routing_and_parsing_errors_use_the_error_body(keyed: httpx.Client) -> None:
    assert "/nowhere" in str(error_body(keyed.get("/nowhere", headers=A), 404)["error"])
    wrong = keyed.get("/v1/generate", headers=A)
    assert error_body(wrong, 405) and wrong.headers["allow"] == "POST"
    assert error_body(keyed.get("/v1/requests/x"), 401)
    assert keyed.get("/v1/requests/x").headers["www-authenticate"] == "Bearer"
    for escaped in ("..%2F..", "%2E%2E", "..%2F..%2Fmetrics"):
        error_body(keyed.get(f"/v1/requests/{escaped}", headers=A), 404)
    for broken in (b'{"prompt": "a', b"[1, 2", b"\xff\xfe", b""):
        bad = keyed.post("/v1/generate", content=broken, headers={
            **A, "content-type": "application/json"})
        assert error_body(bad, 422)["field"] == "body", broken
    unparsed = error_body(keyed.post("/v1/generate", content=b'{"prompt": }', headers={
        **A, "content-type": "application/json"}), 422)
    assert "not valid JSON" in str(unparsed["error"])


def test_the_body_limit_holds_for_chunked_bodies(keyed: httpx.Client) -> None:
    def chunks(total: int, piece: bytes) -> Iterator[bytes]:
        for _ in range(total // len(piece)):
            yield piece

    huge = keyed.post("/v1/generate", content=chunks(10 << 20, b" " * 65536),
                      headers={**A, "content-type": "application/json"})
    assert "api.max_body_bytes" in str(error_body(huge, 413)["error"])
    declared = keyed.post("/v1/generate", content=b" " * 70000,
                          headers={**A, "content-type": "application/json"})
    error_body(declared, 413)
    # A chunked body under the limit still goes through.
    small = keyed.post("/v1/generate", content=iter([b'{"prompt": "a cat", ',
                                                     b'"output_format": "npy"}']),
                       headers={**A, "content-type": "application/json"})
    assert small.status_code == 202, small.text


def test_redis_down_answers_503_with_retry_after(api_stack: Settings) -> None:
    nowhere = f"redis://127.0.0.1:{free_port('127.0.0.1')}/0"
    settings = api_stack.model_copy(update={
        "redis": api_stack.redis.model_copy(update={"url": nowhere})})
    routes = [("POST", "/v1/generate", BODY), ("GET", "/v1/requests/0123abcd", None),
              ("GET", "/v1/requests/0123abcd/result", None),
              ("GET", "/v1/requests/0123abcd/events", None),
              ("DELETE", "/v1/requests/0123abcd", None),
              ("POST", "/v1/resume", {"request_id": "0123abcd"}),
              ("POST", "/v1/videos", {"prompt": "a boat"}),
              ("GET", "/v1/dashboard", None), ("GET", "/metrics", None)]
    with serve_api(settings, ApiSettings()) as url, \
            httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda r: http.request(r[0], r[1], json=r[2]), routes))
        for (_, path, _), answer in zip(routes, answers, strict=True):
            body = error_body(answer, 503)
            assert answer.headers["retry-after"] == "5", path
            assert "Redis is unreachable" in str(body["error"]), path
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").json()["checks"]["redis"] is False


@pytest.fixture
def doomed_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """A stack of its own whose store the test stops."""
    stack = EmbeddedStack(load_settings(data_dir=str(tmp_path_factory.mktemp("doomed-api")),
                                        store={"segment_mib": 16}, model=TEST_MODEL))
    with stack:
        yield stack


@pytest.mark.slow  # starts and stops a stack of its own
def test_store_down_answers_503_for_a_result(api_stack: Settings, quiet: redis.Redis,
                                             doomed_store: EmbeddedStack) -> None:
    assert doomed_store.addresses is not None
    # The doomed stack's store, with the workerless stack's Redis that stays up.
    store = doomed_store.resolved(doomed_store.addresses).store
    settings = api_stack.model_copy(update={"store": store})
    with serve_api(settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        request_id = http.post("/v1/generate", json=BODY).json()["id"]
        # As if the pipeline had finished long ago: DONE, with an output that has expired.
        output = StoreKey("default", KeyKind.OUTPUT, request_id)
        quiet.hset(request_record("default", request_id),
                   mapping={"state": "DONE", "output_key": str(output), "updated_at": "0"})
        path = f"/v1/requests/{request_id}/result"
        assert "expired" in str(error_body(http.get(path), 410)["error"])
        doomed_store.stop()

        def unavailable() -> httpx.Response | None:
            answer = http.get(path)
            return answer if answer.status_code == 503 else None

        answer = wait_until(unavailable, timeout_s=60,
                            what="a 503 for the result once the store is gone")
        assert error_body(answer, 503) and answer.headers["retry-after"] == "5"


def test_a_request_too_costly_is_refused_and_a_costly_one_runs_as_batch(
        keyed: httpx.Client) -> None:
    # 1024x1024, 129 frames, 100 steps with CFG: 33 latent frames x 4096 patches x 200.
    huge = {**BODY, "width": 1024, "height": 1024, "num_frames": 129,
            "num_inference_steps": 100}
    body = error_body(keyed.post("/v1/generate", json=huge, headers=A), 422)
    assert body["field"] == "cost"
    assert "27,033,600" in str(body["error"]) and "api.max_cost=5,000,000" in str(body["error"])
    # One 1024x1024 frame at 100 steps (819,200) fits, but not among interactive work.
    costly = {**BODY, "width": 1024, "height": 1024, "num_frames": 1,
              "num_inference_steps": 100}
    accepted = keyed.post("/v1/generate", json=costly, headers=A)
    assert accepted.status_code == 202, accepted.text
    status = keyed.get(f"/v1/requests/{accepted.json()['id']}", headers=A).json()
    assert status["priority"] == "batch"
    small = keyed.post("/v1/generate", json=BODY, headers=A).json()
    assert keyed.get(f"/v1/requests/{small['id']}", headers=A).json()["priority"] == \
        "interactive"
