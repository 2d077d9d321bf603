"""Approximate reuse through the worker pool: a request in approximate mode is rewritten at
encode into "a similar request's first k steps (its prompt, its seed), then my prompt", and
gives bit for bit what the monolithic WanPipeline gives with the source's seed and a prompt
switch at step k (CPU, float32, one thread per op); a request in exact mode never does."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from cachesvc.counters import read_totals
from cachesvc.value_index import held_inputs
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import Reuse, ReuseMode, StoreKey
from supervision.processes import ChildProcess
from tests.workers_harness import (
    make_spec,
    paused,
    read_frames,
    reference,
    run_request,
    start_worker,
    wait_done,
    wait_for,
)
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import PreemptMode, State
from workers.queue.served_model import MODEL_CARD
from workers.queue.submit import new_request_id, submit
from workers.stages.prompt_view import FIRST_STEP

pytestmark = pytest.mark.slow  # starts a worker process of its own

# Any two prompts of the tiny random model are this similar: the table is the test's input (a
# served model's is measured, ``bench.reuse_calibrate``), half the steps for any neighbour.
TABLE = [[0.05, 0.5]]
APPROXIMATE = Reuse(ReuseMode.APPROXIMATE, min_similarity=0.05, max_skip=0.5)


@pytest.fixture(scope="module")
def reusing_encoder(worker_settings: Settings, client: redis.Redis,
                    pool: dict[Stage, list[ChildProcess]],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The pool's encode worker held, and one whose model card holds a reuse table in its
    place (the same model files: the same fingerprints and keys)."""
    directory = tmp_path_factory.mktemp("reuse") / "model"
    shutil.copytree(worker_settings.model.dir, directory)
    card_path = directory / MODEL_CARD
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    # The shipped model's vector: the worker loads the denoiser for it at encode.
    card.setdefault("model", {}).update(reuse_table=TABLE, reuse_vector=FIRST_STEP)
    card_path.write_text(json.dumps(card))
    settings = worker_settings.model_copy(update={"model": worker_settings.model.model_copy(
        update={"dir": directory})})
    with paused(pool[Stage.ENCODE]):
        child = start_worker(settings, Stage.ENCODE, directory.parent, client, "encode-reuse")
        try:
            yield
        finally:
            child.stop()


def test_an_approximate_hit_is_the_sources_prefix_then_its_own_prompt_bit_for_bit(
        worker_settings: Settings, client: redis.Redis, reusing_encoder: None,
        pipe: object) -> None:
    source = make_spec(tenant="reuse", prompt="a red fox in the snow", seed=101,
                       num_inference_steps=6)
    run_request(worker_settings, client, source)
    asked = make_spec(tenant="reuse", prompt="a large red fox in the snow", seed=202,
                      num_inference_steps=6, reuse=APPROXIMATE)
    frames = run_request(worker_settings, client, asked)
    record = wait_done(client, asked)
    hit = record.approximate
    assert hit is not None and hit.source_request_id == source.request_id
    assert hit.step == 3 and 0.05 <= hit.similarity <= 1.0  # half of 6 steps, as the table says
    # What it computed, and what the record now holds: the source's seed and prompt for the
    # first three steps, then its own prompt.
    assert record.spec.seed == source.seed
    assert [(s.prompt, s.until_step) for s in record.spec.schedule] == [
        (source.schedule[0].prompt, 3), (asked.schedule[0].prompt, 6)]
    assert record.counter("resumed_from") == 3  # the source's checkpoint: 3 steps not run
    assert record.counter("hits:approx") == record.counter("lookups:approx") == 1
    assert np.array_equal(frames, reference(pipe, record.spec))
    # Its start was held from the value sweeper from encode on. Decode lets go of its
    # embeddings; the checkpoint's hold stays for the sweeper to drop, the request ended.
    start = wait_done(client, source).checkpoints()[3]
    wait_until(lambda: set(held_inputs(client, "reuse", time.time()).get(asked.request_id, {}))
               == {start}, timeout_s=30, what="only the starting checkpoint still held")

    # The same request again, approximate: the same rewrite, so the output is a hit.
    again = dataclasses.replace(asked, request_id=new_request_id())
    assert np.array_equal(run_request(worker_settings, client, again), frames)
    assert wait_done(client, again).counter("hits:output") == 1

    # Exact mode never takes it, not even with the rewrite's own seed, whose only neighbour
    # is an approximate result: it computes its own trajectory from step 0.
    exact = dataclasses.replace(asked, request_id=new_request_id(), reuse=Reuse(),
                                seed=source.seed)
    own = run_request(worker_settings, client, exact)
    done = wait_done(client, exact)
    assert done.approximate is None and done.spec == exact
    assert done.counter("resumed_from") == 0 and done.counter("hits:output") == 0
    assert done.counter("lookups:approx") == 0
    assert np.array_equal(own, reference(pipe, exact))
    assert not np.array_equal(own, frames)

    # One ledger: the records' lookups add up to the cache counters, the rewrite's second
    # encode included (each text is looked up once per job).
    records = [wait_done(client, s) for s in (source, asked, again, exact)]
    for kind in ("embed", "approx"):
        shown = sum(r.counter(f"lookups:{kind}") for r in records)
        wait_until(lambda k=kind, n=shown: read_totals(client, "reuse").get(f"{k}.lookups")
                   == n, timeout_s=90, what=f"{kind} lookups counted as the records show")


def test_no_neighbour_similar_enough_leaves_the_request_as_asked(
        worker_settings: Settings, client: redis.Redis, reusing_encoder: None) -> None:
    source = make_spec(tenant="reuse-far", prompt="a blue whale", seed=5, num_inference_steps=4)
    run_request(worker_settings, client, source)
    strict = Reuse(ReuseMode.APPROXIMATE, min_similarity=1.0, max_skip=0.5)
    asked = make_spec(tenant="reuse-far", prompt="a green parrot on a branch", seed=6,
                      num_inference_steps=4, reuse=strict)
    run_request(worker_settings, client, asked)
    record = wait_done(client, asked)
    assert record.approximate is None and record.spec == asked
    assert record.counter("lookups:approx") == 1 and record.counter("hits:approx") == 0
    # Another tenant's identical prompt is never a neighbour.
    other = make_spec(tenant="reuse-other", prompt="a blue whale", seed=7,
                      num_inference_steps=4, reuse=APPROXIMATE)
    run_request(worker_settings, client, other)
    assert wait_done(client, other).approximate is None


def test_a_source_whose_checkpoints_are_gone_is_a_miss(
        worker_settings: Settings, client: redis.Redis, reusing_encoder: None) -> None:
    source = make_spec(tenant="reuse-gone", prompt="a red fox", seed=1, num_inference_steps=4)
    run_request(worker_settings, client, source)
    cache = open_cache(worker_settings)
    try:  # the store is a cache: every checkpoint of the source is evicted
        for key in wait_done(client, source).checkpoints().values():
            cache.remove(StoreKey.parse(key))
    finally:
        cache.close()
    asked = make_spec(tenant="reuse-gone", prompt="a red fox at night", seed=2,
                      num_inference_steps=4, reuse=APPROXIMATE)
    run_request(worker_settings, client, asked)
    record = wait_done(client, asked)
    assert record.approximate is None and record.counter("resumed_from") == 0


def test_a_rewritten_request_parked_and_resumed_stays_bit_identical(
        worker_settings: Settings, client: redis.Redis, reusing_encoder: None,
        pipe: object) -> None:
    long = {"num_inference_steps": 60, "width": 64, "height": 64}
    source = make_spec(tenant="reuse-park", prompt="a red fox in the snow", seed=301, **long)
    run_request(worker_settings, client, source)
    asked = make_spec(tenant="reuse-park", prompt="a red fox asleep in the snow", seed=302,
                      reuse=APPROXIMATE, **long)
    submit(client, asked)
    wait_for(client, asked, State.DENOISING, min_step=31)  # past the source's 30 steps
    assert Lifecycle(client).ask_preempt(asked.tenant, asked.request_id, PreemptMode.PARK)
    wait_for(client, asked, State.PREEMPTED)
    parked = Records(client).get(asked.tenant, asked.request_id)
    assert parked is not None and parked.approximate is not None
    Lifecycle(client).resume(parked)
    record = wait_done(client, asked)
    assert record.counter("preemptions") == 1 and record.counter("resumes") == 1
    assert record.counter("resumed_from") > 30  # from its own checkpoint, past the source's
    assert record.spec == parked.spec  # still the rewritten request, not rewritten again
    assert np.array_equal(read_frames(worker_settings, record), reference(pipe, record.spec))
