"""Out of device memory, as a GPU worker meets it, injected on the CPU: a forward raises
``torch.OutOfMemoryError`` once it holds more token-rows than a made-up device holds. A batch
that does not fit is retried run by run and forwards shrink, so the runs that fit finish,
exact; a run whose own rows never fit fails at once, naming itself; the worker serves on. A
warm-up that runs out of memory shrinks the engine's bound instead of killing the worker, and
a worker whose model does not fit is not restarted in a loop."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cachesvc.redis_client import open_redis
from cachesvc.waiting import wait_until
from supervision.processes import ChildProcess
from supervision.supervisor import EXIT_CANNOT_FIT, Backoff, Supervisor
from tests.workers_harness import (
    embedded_serving,
    make_spec,
    read_frames,
    reference,
    start_worker,
    wait_done,
)
from workers.families import wan
from workers.main import build_worker
from workers.queue.messages import Stage
from workers.queue.schema import State
from workers.queue.submit import submit

pytestmark = pytest.mark.slow
SMALL, LARGE = 32, 64  # sides: a large row holds four times a small one's image tokens


@pytest.fixture
def device_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The made-up device: it holds ``capacity[0]`` small rows' worth of latents in one
    forward (the rows' latent elements are what is counted)."""
    capacity = [2]
    predict = wan.WanDenoiser.predict
    # One small row's latents: the test model's (1, 16, 2, 4, 4) at 32x32 and 5 frames.
    small_row = 16 * 2 * (SMALL // 8) ** 2

    def bounded(self: wan.WanDenoiser, latents: torch.Tensor, *args: object,
                **kwargs: object) -> torch.Tensor:
        if latents.numel() > capacity[0] * small_row:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return predict(self, latents, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(wan.WanDenoiser, "predict", bounded)
    yield capacity


def test_a_run_that_cannot_fit_fails_alone_and_the_rest_finish_exact(
        device_of: list[int], model_dir: Path, tmp_path: Path, pipe: object) -> None:
    with embedded_serving(tmp_path / "stack", model_dir) as served:
        # No warm-up: the first steps find the device's bound themselves.
        settings = served.model_copy(update={
            "workers": served.workers.model_copy(update={"warm_up_s": 0})})
        client = open_redis(settings)
        others = [start_worker(settings, stage, tmp_path, client, f"{stage}-oom")
                  for stage in (Stage.ENCODE, Stage.DECODE)]
        worker, handler = build_worker(Stage.DENOISE, settings)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            small = [make_spec(seed=s, num_frames=5) for s in range(3)]
            large = make_spec(width=LARGE, height=LARGE, num_frames=5)
            for spec in [*small, large]:
                submit(client, spec)
            failed = wait_done(client, large)
            assert failed.state is State.FAILED
            assert large.request_id in (failed.error or "") and "memory" in (failed.error or "")
            for spec in small:
                record = wait_done(client, spec)
                assert record.state is State.DONE, record.error
                assert np.array_equal(read_frames(settings, record), reference(pipe, spec))
            # The engine learnt the bound: forwards of at most what fits.
            assert handler.engine.max_tokens < settings.workers.max_batch_tokens
            after = make_spec(seed=9, num_frames=5)
            submit(client, after)
            assert wait_done(client, after).state is State.DONE
        finally:
            worker.stop.set()
            thread.join(30)
            for child in others:
                child.stop()


def test_a_warm_up_out_of_memory_shrinks_the_engine_instead_of_crashing(
        device_of: list[int], model_dir: Path, tmp_path: Path) -> None:
    device_of[0] = 3  # the warm-up's fourth row does not fit
    # The warm-up proves batches at the served model's defaults: here the small rows'.
    with embedded_serving(tmp_path / "stack", model_dir, width=SMALL, height=SMALL,
                          num_frames=5) as settings:
        _, handler = build_worker(Stage.DENOISE, settings)
    engine = handler.engine
    row = engine.model.tokens(make_spec()) + engine.model.text_shape()[0]
    assert engine.max_tokens == 4 * row // 2  # half the forward that did not fit


def test_a_worker_whose_model_does_not_fit_is_not_restarted(tmp_path: Path) -> None:
    child = ChildProcess("oom", [sys.executable, "-c", f"import sys; sys.exit({EXIT_CANNOT_FIT})"],
                         tmp_path / "oom.log", {})
    child.start()
    supervisor = Supervisor(Backoff(initial_s=0.01))
    supervisor.adopt(child, "worker")
    wait_until(lambda: (supervisor.tick(), supervisor.status()[0].last_exit)[1] is not None,
               timeout_s=30, what="the worker's exit seen")
    status = supervisor.status()[0]
    assert "out of device memory" in status.describe_exit() and not status.alive
    supervisor.tick()
    assert supervisor.status()[0].restarts == 0
