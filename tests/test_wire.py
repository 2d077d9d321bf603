"""The one wire style on a real Redis: what processes publish reads back as it was written;
a payload of a version this release does not read is a typed error naming the kind and the
version, which a reader of published facts passes over with a warning (the next publish
writes it again); names written before the envelope still read."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import redis
import xxhash
from pydantic import TypeAdapter
from pydantic_core import to_json

from cachesvc.wire import UnknownVersionError, Wire, WireError
from keys.names import adapter_index, served_model, served_tokenizer, supervised_children
from supervision.supervisor import ChildStatus, publish, read_published
from uploads.adapters import AdapterInfo, AdapterRegistry
from workers.queue.messages import Job, Stage
from workers.queue.metrics.adapters import (
    WorkerAdapters,
    publish_adapter_stats,
    read_adapter_stats,
)
from workers.queue.served_model import (
    RETIRED_TOKENIZER_S,
    FamilyLimits,
    ServedModel,
    Workflow,
    publish_served,
    read_served,
    read_tokenizer,
)

# A text-to-image family's limits, as Qwen-Image's with a 507-token prompt.
IMAGES = FamilyLimits(False, 1, 16, 507, frozenset({Workflow.TEXT_TO_IMAGE}))


def newer(raw: bytes) -> bytes:
    """``raw`` as a release one version ahead would have written it."""
    found = json.loads(raw)
    return json.dumps(dict(found, v=found["v"] + 1)).encode()


def test_published_facts_round_trip_and_a_newer_version_is_passed_over(
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    status = ChildStatus("worker-encode-0", "worker-encode", 7, True, 0, None, "", False)
    stats = WorkerAdapters("denoise-1", 2, 1, 0.5, ("a" * 32,), ("a" * 32,))
    model = ServedModel("qwen-image", "shapes", IMAGES)
    try:
        publish(redis_client, [status])
        publish_adapter_stats(redis_client, stats)
        publish_served(redis_client, model, '{"tokenizer": 1}')
        assert read_published(redis_client) == [status]
        assert read_adapter_stats(redis_client) == [stats]
        found = read_served(redis_client)
        assert found is not None and found.limits == model.limits and found.tokenizer

        field = next(iter(redis_client.hkeys(supervised_children())))
        redis_client.hset(supervised_children(), field,
                          newer(redis_client.hget(supervised_children(), field)))
        redis_client.set(served_model(), newer(redis_client.get(served_model())))
        with caplog.at_level(logging.WARNING):
            assert read_published(redis_client) == []
            assert read_served(redis_client) is None
        assert "child status: version 2 is not one this release reads" in caplog.text
        assert "served model: version 3" in caplog.text
    finally:
        redis_client.delete(supervised_children(), served_model())


def test_an_adapter_named_before_the_envelope_still_reads(redis_client: redis.Redis,
                                                          tmp_path: object) -> None:
    registry = AdapterRegistry(lambda: None, redis_client, tmp_path)  # type: ignore[arg-type]
    bare = AdapterInfo("old-style", "b" * 32, 100, 4, 2)
    redis_client.hset(adapter_index("acme"), "old-style",
                      to_json({"name": bare.name, "hash": bare.hash, "size": bare.size,
                               "rank": bare.rank, "targets": bare.targets}))
    try:
        assert registry.list("acme") == [bare]
        assert registry.find("acme", content_hash="b" * 32) == bare
    finally:
        redis_client.delete(adapter_index("acme"))


@pytest.mark.parametrize("envelope", [False, True], ids=["bare", "version-1"])
@pytest.mark.parametrize(("video", "flags", "workflows"), [
    (False, {"image_to_image": True, "inpainting": True},
     {Workflow.TEXT_TO_IMAGE, Workflow.IMAGE_TO_IMAGE, Workflow.INPAINTING}),
    (False, {"image_edit": True}, {Workflow.INSTRUCTION_EDIT}),
    (True, {}, {Workflow.TEXT_TO_VIDEO}),
    (True, {"image_to_video": True}, {Workflow.IMAGE_TO_VIDEO})])
def test_a_model_published_by_an_older_release_still_reads(
        redis_client: redis.Redis, envelope: bool, video: bool, flags: dict[str, bool],
        workflows: set[Workflow]) -> None:
    """A rolling upgrade: an old worker published the served model bare (before the
    envelope) or as version 1, its limits' workflows as four booleans; a new API still
    admits against it, with the same rules, rather than answering 503."""
    model = ServedModel("family", "folder", replace(IMAGES, video=video,
                                                    workflows=frozenset(workflows)),
                        tokenizer="c" * 32)
    old = json.loads(TypeAdapter(ServedModel).dump_json(model))
    del old["limits"]["workflows"]
    old["limits"] |= {"image_to_image": False, "image_to_video": False, "inpainting": False,
                      "image_edit": False, **flags}
    written = {"kind": "served model", "v": 1, "value": old} if envelope else old
    redis_client.set(served_model(), json.dumps(written))
    try:
        assert read_served(redis_client) == model
    finally:
        redis_client.delete(served_model())


def test_the_tokenizer_of_a_model_no_longer_served_expires(redis_client: redis.Redis) -> None:
    """A model change retires the old tokenizer (kept an hour for admissions in flight); the
    new one, and an old one served again, stay."""
    model = ServedModel("qwen-image", "shapes", IMAGES)
    first, second = '{"tokenizer": "first"}', '{"tokenizer": "second"}'
    digests = [served_tokenizer(xxhash.xxh3_128_hexdigest(t.encode())) for t in (first, second)]
    try:
        publish_served(redis_client, model, first)
        old = read_served(redis_client)
        publish_served(redis_client, replace(model, name="other"), second)
        new = read_served(redis_client)
        assert old is not None and new is not None and old.tokenizer != new.tokenizer
        assert 0 < redis_client.ttl(served_tokenizer(old.tokenizer)) <= RETIRED_TOKENIZER_S
        assert redis_client.ttl(served_tokenizer(new.tokenizer)) == -1  # kept
        assert read_tokenizer(redis_client, old.tokenizer) == first  # until it expires
        publish_served(redis_client, model, first)
        assert redis_client.ttl(served_tokenizer(old.tokenizer)) == -1
        assert 0 < redis_client.ttl(served_tokenizer(new.tokenizer)) <= RETIRED_TOKENIZER_S
    finally:
        redis_client.delete(served_model(), *digests)


class _Interleaved(redis.Redis):
    """A client on the same server that lets ``meanwhile`` run right after its first read of a
    key (directly or inside a transaction): another process's write landing between a read
    and the write it decides."""

    def __init__(self, meanwhile: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._meanwhile: Callable[[], None] | None = meanwhile

    def _after_read(self) -> None:
        meanwhile, self._meanwhile = self._meanwhile, None  # once: a transaction retries
        if meanwhile is not None:
            meanwhile()

    def get(self, name: Any) -> Any:
        found = super().get(name)
        self._after_read()
        return found

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        read = pipe.get

        def get(name: Any) -> Any:
            found = read(name)
            self._after_read()
            return found

        pipe.get = get  # type: ignore[method-assign]
        return pipe


def test_two_models_published_together_retire_only_the_tokenizer_not_served(
        redis_client: redis.Redis) -> None:
    """Worker A reads the entry (its own model), worker B publishes model B meanwhile and
    retires A's tokenizer, then A writes: A's model is the one left published, so its
    tokenizer must be the one kept, and B's the one retired."""
    a = ServedModel("qwen-image", "a", IMAGES)
    b = replace(a, name="b")
    tok_a, tok_b = '{"tokenizer": "a"}', '{"tokenizer": "b"}'
    keys = [served_tokenizer(xxhash.xxh3_128_hexdigest(t.encode())) for t in (tok_a, tok_b)]
    try:
        publish_served(redis_client, a, tok_a)
        worker_a = _Interleaved(lambda: publish_served(redis_client, b, tok_b),
                                connection_pool=redis_client.connection_pool)
        publish_served(worker_a, a, tok_a)
        found = read_served(redis_client)
        assert found is not None and found.name == "a"
        assert redis_client.ttl(keys[0]) == -1
        assert 0 < redis_client.ttl(keys[1]) <= RETIRED_TOKENIZER_S
    finally:
        redis_client.delete(served_model(), *keys)


def test_every_kind_of_mismatch_is_a_typed_error() -> None:
    wire: Wire[tuple[int, int]] = Wire("pair", tuple[int, int], version=3)
    assert wire.decode(wire.encode((1, 2))) == (1, 2)
    with pytest.raises(UnknownVersionError, match=r"pair: version 0 is not .* \(3\)"):
        wire.decode(b"[1, 2]")  # bare, and this kind has no reader for version 0
    with pytest.raises(WireError, match="pair: not JSON"):
        wire.decode(b"\x80pickle")
    with pytest.raises(WireError, match="holds a 'other' payload"):
        wire.decode(b'{"kind": "other", "v": 3, "value": [1, 2]}')
    with pytest.raises(WireError, match="pair: unreadable version 3"):
        wire.decode(b'{"kind": "pair", "v": 3, "value": ["x", 2]}')


def test_a_job_of_another_message_version_is_a_typed_error_naming_it() -> None:
    job = Job("a" * 32, "acme", Stage.ENCODE)
    raw = json.loads(job.to_json())
    raw["v"] += 1
    with pytest.raises(UnknownVersionError, match=f"job: version {raw['v']}") as caught:
        Job.from_json(json.dumps(raw))
    assert caught.value.kind == "job"
