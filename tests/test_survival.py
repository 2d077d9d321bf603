"""``diffcache up`` survives the loss of any part: every kind of child SIGKILLed under load is
restarted, a restart of the whole service loses nothing, and every accepted request ends DONE
with frames bit-identical to the monolithic pipeline (one thread per op, CPU, float32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.running_service import RunningService
from cachesvc.waiting import wait_until
from keys import GenerationSpec
from supervision.processes import free_port
from tests.workers_harness import make_spec, reference
from workers.stages.media import decode_npy

pytestmark = pytest.mark.slow

# Every kind of child `diffcache up` starts, in the order the test kills them.
CHILDREN = ("worker-encode-0", "worker-denoise-0", "worker-decode-0", "api", "valkey",
            "mooncake_client", "mooncake_master")


@pytest.fixture
def service(tmp_path: Path, model_dir: Path) -> Iterator[RunningService]:
    running = RunningService.start(tmp_path, model_dir, free_port("127.0.0.1"))
    yield running
    running.kill()


def check_all_done(service: RunningService, pipe: object,
                   accepted: dict[str, GenerationSpec]) -> None:
    for request_id, spec in accepted.items():
        record = service.wait(request_id)
        assert record["state"] == "DONE", record
        frames = decode_npy(service.result(request_id))
        assert np.array_equal(frames, reference(pipe, spec)), request_id


def test_every_kind_of_child_killed_under_load_is_restarted_and_nothing_is_lost(
        service: RunningService, pipe: object) -> None:
    accepted: dict[str, GenerationSpec] = {}
    for n, name in enumerate(CHILDREN):
        load = [make_spec(tenant="default", seed=2000 + 10 * n + i, num_inference_steps=12)
                for i in range(2)]
        for spec in load:
            accepted[service.generate(spec)] = spec
        service.kill_child(name)
        assert service.children()[name]["last_exit"] == "killed by SIGKILL"
    check_all_done(service, pipe, accepted)
    assert not any(c["crash_looping"] for c in service.children().values())
    restarts = {line.split('child="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in service.call("GET", "/metrics").text.splitlines()
                if line.startswith("diffcache_child_restarts_total")}
    # At least the kill; a storage node may also exit on its own while its master restarts.
    assert all(restarts[name] >= 1 for name in CHILDREN), restarts


def test_a_restart_of_the_whole_service_loses_nothing(service: RunningService, pipe: object,
                                                      model_dir: Path) -> None:
    done = make_spec(tenant="default", seed=3001)
    done_id = service.generate(done)
    service.wait(done_id, {"DONE"})
    long = make_spec(tenant="default", seed=3002, num_inference_steps=100, width=64,
                     height=64)  # still denoising when the drain comes
    in_flight = {service.generate(spec): spec for spec in
                 [long, *(make_spec(tenant="default", seed=3003 + i, num_inference_steps=30)
                          for i in range(2))]}
    first = next(iter(in_flight))
    denoised = wait_until(lambda: (s := service.status(first))["state"] == "DENOISING"
                          and s["step"] >= 11 and s, timeout_s=120, interval_s=0.05,
                          what=f"{first} denoising at step 11")
    assert service.stop() == 0  # the drain checkpoints it where it stands, on disk too
    again = RunningService.start(service.data_dir, model_dir, service.port)
    try:
        # The DONE request's output comes from disk: the store restarted empty.
        assert np.array_equal(decode_npy(again.result(done_id)), reference(pipe, done))
        check_all_done(again, pipe, in_flight)
        # The store restarted empty too; the checkpoint the drain kept on disk is where the
        # request went on from, not step 0 (checkpoints come every 10 of its 100 steps).
        resumed = again.status(first)
        assert resumed["preemptions"] >= 1, resumed  # the drain took it off mid-denoise
        assert resumed["resumed_from"] >= denoised["step"] - 10 > 0, resumed
        assert again.stop() == 0
    finally:
        again.kill()  # nothing left running, however the test ended
