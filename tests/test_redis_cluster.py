"""The whole service on a Redis Cluster: three Valkey masters with a replica each, on loopback,
created by the test. Requests are generated, preempted, resumed and cancelled; a worker and the
queue's master are killed with SIGKILL; the cache counters still equal the records."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from bench.valkey_cluster import LocalValkeyCluster
from cachesvc.redis_client import open_redis, slot_server
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings, load_settings
from keys import GenerationSpec
from keys.names import QUEUE_TAG, request_record, stats_total
from supervision.processes import ChildProcess
from supervision.stack import EmbeddedStack
from tests.conftest import TEST_MODEL
from tests.test_counter_truth import KINDS, Workload, recorded, settled_export
from tests.workers_harness import (
    make_spec,
    read_frames,
    reference,
    serve_api,
    serving,
    start_worker,
    stop_owner_when,
    wait_done,
    worker_pool,
)
from workers.queue.messages import Stage
from workers.queue.queue_server import queue_server
from workers.queue.records import Records
from workers.queue.retention import Retention
from workers.queue.schema import State
from workers.queue.submit import submit
from workers.stages.media import decode_npy

# Starts worker processes and a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4}
LONG = {"num_inference_steps": 40, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalValkeyCluster]:
    with LocalValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def on_cluster(valkey_cluster: LocalValkeyCluster, model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A Mooncake master and storage node, with the cluster as the service's Redis."""
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("cluster-stack")),
                             store={"segment_mib": 128}, model=TEST_MODEL,
                             redis={"url": valkey_cluster.url, "cluster": True})
    stack = EmbeddedStack(settings)
    with stack as addresses:
        yield serving(stack.resolved(addresses), model_dir)


@pytest.fixture(scope="module")
def cluster_client(on_cluster: Settings) -> RedisCluster:
    client = open_redis(on_cluster)
    assert isinstance(client, RedisCluster)
    return client


@pytest.fixture(scope="module")
def cluster_pool(on_cluster: Settings, cluster_client: RedisCluster,
                 tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[Stage, list[ChildProcess]]]:
    with worker_pool(on_cluster, cluster_client, tmp_path_factory.mktemp("cluster-worker-logs"),
                     "c0") as workers:
        yield workers


@pytest.fixture(scope="module")
def api_url(on_cluster: Settings, cluster_pool: object) -> Iterator[str]:
    with serve_api(on_cluster, ApiSettings()) as url:
        yield url


def test_the_queue_lives_in_one_slot_and_the_cache_spreads_over_the_masters(
        valkey_cluster: LocalValkeyCluster, cluster_client: RedisCluster) -> None:
    slots = {cluster_client.keyslot(request_record(t, "r1")) for t in ("acme", "other")}
    assert slots == {cluster_client.keyslot(QUEUE_TAG)}
    masters = {valkey_cluster.master_of(stats_total(f"tenant-{i}")).port for i in range(32)}
    assert len(masters) == valkey_cluster.masters


def test_generate_then_cancel_through_the_api(api_url: str, pipe: object,
                                              cluster_pool: dict[Stage, list[ChildProcess]]
                                              ) -> None:
    with httpx.Client(base_url=api_url, timeout=60) as http:
        body = {"prompt": "a red boat on the sea", "negative_prompt": "blurry", "seed": 5,
                "output_format": "npy", "guidance_scale": 4.0, **SMALL}
        accepted = http.post("/v1/generate", json=body)
        assert accepted.status_code == 202, accepted.text
        request_id = accepted.json()["id"]
        # The events stream follows the record's sharded channel to the end.
        with http.stream("GET", f"/v1/requests/{request_id}/events", timeout=120) as events:
            last = [line for line in events.iter_lines() if line.startswith("data: ")][-1]
        assert last == 'data: {"state": "DONE"}'
        result = http.get(f"/v1/requests/{request_id}/result")
        assert result.status_code == 200
        spec = GenerationSpec.create(request_id="ref", tenant="default", prompt=body["prompt"],
                                     negative_prompt="blurry", seed=5, guidance_scale=4.0,
                                     **SMALL)
        assert np.array_equal(decode_npy(result.content), reference(pipe, spec))

        long = http.post("/v1/generate", json={"prompt": "a long walk", "seed": 6,
                                               "output_format": "npy", **LONG})
        assert long.status_code == 202, long.text
        cancelled = http.delete(f"/v1/requests/{long.json()['id']}")
        assert cancelled.status_code == 202, cancelled.text
        with http.stream("GET", f"/v1/requests/{long.json()['id']}/events",
                         timeout=120) as events:
            last = [line for line in events.iter_lines() if line.startswith("data: ")][-1]
        assert last == 'data: {"state": "CANCELLED"}'


def test_preempted_resumed_and_repeated_requests_count_what_their_records_show(
        on_cluster: Settings, cluster_client: RedisCluster, cluster_pool: object) -> None:
    work = Workload(on_cluster, cluster_client)
    work.repeats()
    work.preemptions()
    expected = recorded(work.done)
    for kind in KINDS:
        assert expected[f"{kind.value}.hits"] > 0, (kind, expected)
    observed = settled_export(cluster_client, work.tenant, expected,
                              on_cluster.cache.stats_flush_s)
    assert observed == expected


def test_with_the_queue_masters_replica_down_requests_are_still_accepted(
        valkey_cluster: LocalValkeyCluster, cluster_client: RedisCluster,
        cluster_pool: object) -> None:
    master = valkey_cluster.master_of(QUEUE_TAG)
    replica = next(n for n in valkey_cluster.nodes if n is not master and n.child.alive()
                   and n.info("replication").get("master_port") == master.port)
    replica.child.kill()
    wait_until(lambda: master.info("replication")["connected_slaves"] == 0, timeout_s=30,
               what="the queue's master without its replica")
    try:  # the first acceptance waits for the replica in vain, the next ones do not wait
        specs = [make_spec(seed=980 + n, num_inference_steps=2) for n in range(3)]
        for spec in specs:
            submit(cluster_client, spec)
        assert [wait_done(cluster_client, s).state for s in specs] == [State.DONE] * 3
    finally:
        replica.child.start()
        valkey_cluster.wait_healthy()


def test_a_killed_worker_and_a_killed_queue_master_lose_no_accepted_request(
        valkey_cluster: LocalValkeyCluster, on_cluster: Settings, pipe: object,
        cluster_client: RedisCluster, cluster_pool: dict[Stage, list[ChildProcess]],
        tmp_path: Path) -> None:
    denoisers = cluster_pool[Stage.DENOISE]
    denoisers.append(start_worker(on_cluster, Stage.DENOISE, tmp_path, cluster_client,
                                  "denoise-c1"))
    specs = [make_spec(seed=950 + n, **LONG) for n in range(2)] + \
        [make_spec(seed=960 + n, num_inference_steps=12) for n in range(3)]
    for spec in specs[:2]:
        submit(cluster_client, spec)
    # A worker dies mid-denoise: another takes its job over from the last checkpoint.
    owner, _ = stop_owner_when(cluster_client, specs[0], Stage.DENOISE, denoisers,
                               lambda f: f.get("state") == State.DENOISING.value
                               and int(f.get("step", 0)) >= 3)
    assert owner.pid is not None
    os.kill(owner.pid, signal.SIGKILL)
    denoisers.remove(owner)
    # Then the master of the queue's slot dies while requests are in flight; its replica,
    # which held every accepted request before the 202 (WAIT), is promoted.
    for spec in specs[2:]:
        submit(cluster_client, spec)
    before = slot_server(cluster_client, QUEUE_TAG)
    assert before.replicas == 1
    killed, promoted = valkey_cluster.kill_master_of(QUEUE_TAG)
    assert promoted.port != killed.port
    # Submitted at once: the service's client still knows the dead master, so this either
    # lands on the promoted one or fails on the dead connection (a 503 to an API caller, who
    # retries), after which the client knows the new master.
    late = make_spec(seed=990, num_inference_steps=12)
    try:
        submit(cluster_client, late)
    except redis.ConnectionError:
        submit(cluster_client, late)
    specs.append(late)
    records = [wait_done(cluster_client, spec, timeout_s=300)
               for spec in specs]
    assert [r.state for r in records] == [State.DONE] * len(specs)
    assert np.array_equal(read_frames(on_cluster, records[0]), reference(pipe, specs[0]))
    assert records[0].fields["attempt:denoise"] != "1"
    assert queue_server(cluster_client).connection_pool.connection_kwargs["port"] == promoted.port


def test_retention_finds_and_expires_every_tenants_finished_requests(
        on_cluster: Settings, cluster_client: RedisCluster, cluster_pool: object) -> None:
    spec = make_spec(tenant="late-tenant", seed=970, num_inference_steps=2)
    submit(cluster_client, spec)
    assert wait_done(cluster_client, spec).state is State.DONE
    retention = Retention(cluster_client, on_cluster.retention)
    # A sweep far in the future: every finished request is past its keeping time. The tenant
    # is found by a scan of the queue's server, whichever master holds it now.
    records = Records(cluster_client)
    removed: list[int] = []

    def swept() -> bool:
        removed.append(retention.sweep(now_s=time.time() + 30 * 86400).records)
        return records.get(spec.tenant, spec.request_id) is None

    wait_until(swept, timeout_s=60, interval_s=0.05, what=f"{spec.request_id} expired")
    assert sum(removed) >= 1
