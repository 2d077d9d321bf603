"""A head and three nodes on four machines (network namespaces on a bridge, with addresses that
exist only inside them): stages run on different nodes and read each other's tensors from
storage nodes on other hosts, the cache is cluster-wide, a preempted job moves between nodes,
and a lost machine costs time, never a request. Conditions of bit-identity: CPU, float32, one
intra-op thread per op in every worker and in the reference."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.netns import Driver, Host, NodeSpec, network, start_cluster, unavailable
from tests.workers_harness import reference
from workers.queue.spec_json import spec_from_json
from workers.stages.media import decode_npy

WHY_NOT = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

API_PORT = 8000
# node -> the stages it runs; n3 can stand in for n1 (encode) and n2 (denoise).
NODES = {"n1": "encode", "n2": "denoise", "n3": "decode,encode,denoise"}
SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4,
         "negative_prompt": "blurry", "guidance_scale": 5.0, "output_format": "npy"}
LONG = {**SMALL, "num_inference_steps": 40}


@dataclass
class Cluster:
    hosts: dict[str, Host]
    driver: Driver
    tmp: Path

    def pid(self, node: str, child: str) -> int:
        return int(self.driver.call("children")[f"{node}/{child}"])

    @contextmanager
    def paused(self, node: str, child: str) -> Iterator[None]:
        """``child`` of ``node`` takes no work while the block runs (SIGSTOP, then SIGCONT)."""
        pid = self.pid(node, child)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def run(self, prompt: str, seed: int, **body: object) -> tuple[str, dict[str, str]]:
        request_id = self.driver.call("generate", body={
            "prompt": prompt, "seed": seed, **SMALL, **body})
        return request_id, self.finish(request_id)

    def finish(self, request_id: str) -> dict[str, str]:
        out = self.tmp / f"{request_id}.npy"
        status = self.driver.call("wait", id=request_id, out=str(out))
        assert status["state"] == "DONE", status
        return dict(self.driver.call("fields", id=request_id))

    def frames(self, request_id: str) -> np.ndarray:
        return decode_npy((self.tmp / f"{request_id}.npy").read_bytes())


def host_of(fields: dict[str, str], stage: str) -> str:
    """The machine whose worker ran ``stage``: consumer names are ``<hostname>-<pid>``."""
    return fields[f"worker:{stage}"].rpartition("-")[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    with network(["head", *NODES]) as hosts:
        driver = start_cluster(hosts, {n: NodeSpec(stages) for n, stages in NODES.items()},
                               model_dir, tmp, API_PORT, DIFFCACHE_WORKERS__IDLE_TIMEOUT_S="3",
                               DIFFCACHE_WORKERS__PREEMPT="false",
                               # ``decode_jobs`` counts a request's entries in the decode
                               # stream, acknowledged ones included.
                               DIFFCACHE_RETENTION__ACKNOWLEDGED_S="3600",
                               # One a node: pausing worker-denoise-0 stands a node's aside.
                               DIFFCACHE_WORKERS__DENOISE_WORKERS="1")
        try:
            yield Cluster(hosts, driver, tmp)
        finally:
            driver.close()


def test_each_stage_on_another_node_bit_identical_to_the_pipeline(
        cluster: Cluster, pipe: object) -> None:
    # n3's encode and denoise stand aside: the stages must land on three machines.
    with cluster.paused("n3", "worker-encode-0"), cluster.paused("n3", "worker-denoise-0"):
        request_id, fields = cluster.run("a lighthouse in fog", 101)
    assert [host_of(fields, s) for s in ("encode", "denoise", "decode")] == ["n1", "n2", "n3"]
    spec = spec_from_json(fields["spec"])
    assert np.array_equal(cluster.frames(request_id), reference(pipe, spec))


def test_the_embedding_cache_is_shared_across_machines(cluster: Cluster) -> None:
    with cluster.paused("n3", "worker-encode-0"):
        _, first = cluster.run("a red bicycle by a canal", 7, negative_prompt="a blue car")
    with cluster.paused("n1", "worker-encode-0"):
        _, second = cluster.run("a red bicycle by a canal", 8, negative_prompt="a blue car")
    assert host_of(first, "encode") == "n1" and host_of(second, "encode") == "n3"
    assert int(first["hits:embed"]) == 0
    assert int(second["hits:embed"]) == int(second["lookups:embed"]) > 0


def test_a_job_preempted_on_one_node_resumes_on_another_bit_exact(
        cluster: Cluster, pipe: object) -> None:
    driver = cluster.driver
    with cluster.paused("n3", "worker-denoise-0"):
        request_id = driver.call("generate", body={
            "prompt": "a paper boat on a pond", "seed": 303, **LONG})
        driver.call("wait_fields", id=request_id, field="checkpoint_step", at_least=4)
        driver.call("preempt", id=request_id, mode="park")
        parked = driver.call("wait_state", id=request_id, state="PREEMPTED")
    assert host_of(parked, "denoise") == "n2"
    with cluster.paused("n2", "worker-denoise-0"):
        driver.call("resume", id=request_id)
        fields = cluster.finish(request_id)
    assert host_of(fields, "denoise") == "n3" and int(fields["resumed_from"]) >= 4
    spec = spec_from_json(fields["spec"])
    assert np.array_equal(cluster.frames(request_id), reference(pipe, spec))


def test_a_lost_machine_costs_time_not_the_request(cluster: Cluster, pipe: object) -> None:
    """Last: n2 (a denoise worker and a storage node) is gone for good, mid-job. Its job is
    taken over on n3 once its lease runs out, and whatever only n2's memory held reads as a
    miss and is made again, never as an error."""
    driver = cluster.driver
    with cluster.paused("n3", "worker-denoise-0"):
        request_id = driver.call("generate", body={
            "prompt": "a lantern on a snowy street", "seed": 404, **LONG})
        before = driver.call("wait_fields", id=request_id, field="step", at_least=3)
        assert host_of(before, "denoise") == "n2"
        cluster.hosts["n2"].kill_everything()
    fields = cluster.finish(request_id)
    assert host_of(fields, "denoise") == "n3"
    assert driver.call("decode_jobs", id=request_id) == 1  # published once
    spec = spec_from_json(fields["spec"])
    assert np.array_equal(cluster.frames(request_id), reference(pipe, spec))
    # Every earlier output, embedding and checkpoint that lived on n2 is gone with it: the
    # same requests again still finish, identical, recomputing what they must.
    _, again = cluster.run("a lighthouse in fog", 101)
    assert again["state"] == "DONE" and "error" not in again
