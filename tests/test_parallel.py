"""A denoise worker over two ranks (gloo, one thread each, CPU, float32): with its sequence
split, its outputs are bit-identical to the diffusers pipeline split alike
(``ContextParallelConfig`` on two ranks), alone and batched; with its rows split, to the
pipeline on one device. A rank killed mid-request costs time, never the request; a request
parked on a group resumes there; a split the model cannot take is refused at start-up,
naming the setting."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from cachesvc.waiting import wait_until
from config.settings import ApiSettings, DenoiseParallelSettings, WorkerSettings
from keys import GenerationSpec, LoraUse, StepCache, StepCachePolicy
from supervision.processes import free_port
from tests.test_engine import batched_forwards, offered_together
from tests.workers_harness import (
    ModelService,
    make_spec,
    model_service,
    read_frames,
    reference,
    serve_api,
    start_worker,
    stop_owner_when,
    wait_done,
    wait_for,
)
from workers.families import qwen_image, wan
from workers.families.base import CPU, Placement
from workers.parallel.group import SplitForwards
from workers.parallel.layout import ParallelLayout, ParallelLayoutError
from workers.parallel.wire import Wire
from workers.queue.lifecycle import Lifecycle
from workers.queue.messages import Stage
from workers.queue.records import Records
from workers.queue.schema import PreemptMode, State
from workers.queue.submit import submit
from workers.stages.trajectory import checkpoint_every

pytestmark = pytest.mark.slow
ULYSSES_2 = ParallelLayout(ulysses=2)
FAMILIES = {"wan": wan.FAMILY, "qwen-image": qwen_image.FAMILY}


# --- the split checked at start-up ---------------------------------------------------------


def test_a_split_the_model_cannot_take_is_refused_naming_the_setting(
        qwen_model_dir: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    transformer = wan.components("test", seed=0).transformer  # 2 attention heads
    ULYSSES_2.check(transformer, tokens=8)
    with pytest.raises(ParallelLayoutError, match=r"workers\.denoise_parallel\.ulysses: "
                       r"the model's 2 attention heads do not divide among 4 ranks"):
        ParallelLayout(ulysses=4).check(transformer, tokens=8)
    with pytest.raises(ParallelLayoutError, match="9 image tokens do not split into 2"):
        ULYSSES_2.check(transformer, tokens=9)
    ParallelLayout(ulysses=2, ulysses_anything=True).check(transformer, tokens=9)
    with pytest.raises(ParallelLayoutError, match=r"denoise_parallel\.ring: ring attention"):
        ParallelLayout(ring=2).check(transformer, tokens=8)
    # Qwen-Image splits its texts too, whose lengths vary by request.
    qwen = QwenImageTransformer2DModel.from_pretrained(qwen_model_dir / "transformer")
    with pytest.raises(ParallelLayoutError, match=r"denoise_parallel\.ulysses_anything"):
        ULYSSES_2.check(qwen, tokens=8)
    with pytest.raises(ValueError, match="ulysses_anything needs ulysses of 2 or more"):
        WorkerSettings(denoise_parallel=DenoiseParallelSettings(ulysses_anything=True))


def test_rows_are_shared_out_in_order_rank_0_first() -> None:
    rows = ParallelLayout(rows=2)
    assert rows.row_parts(16) == [slice(0, 8), slice(8, 16)]
    assert rows.row_parts(3) == [slice(0, 2), slice(2, 3)]
    assert rows.row_parts(1) == [slice(0, 1), slice(1, 1)]
    assert ParallelLayout(rows=3).row_parts(4) == [slice(0, 2), slice(2, 4), slice(4, 4)]
    assert rows.name == "" and rows.ranks == 2 and rows.sequence_ranks == 1
    with pytest.raises(ValueError, match="set one or the other"):
        DenoiseParallelSettings(rows=2, ulysses=2)


def test_a_job_a_group_cannot_run_is_refused_before_any_forward() -> None:
    # Admission refuses these; a job queued before the split, or resumed, reaches the worker.
    group = SplitForwards(Wire(torch.device("cpu")), ULYSSES_2, torch.float32)
    assert group.refusal(make_spec(), tokens=8) is None
    assert "9 image tokens do not split into 2" in str(group.refusal(make_spec(), tokens=9))
    cached = make_spec(step_cache=StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.2))
    assert "no step cache" in str(group.refusal(cached, tokens=8))
    assert "no adapter" in str(group.refusal(make_spec(loras=(LoraUse("a" * 32, 1.0),)), 8))


def test_keys_name_the_split_and_one_rank_keeps_its_keys(model_dir: Path) -> None:
    lone = wan.WanTrajectory(model_dir, CPU)
    split = wan.WanTrajectory(model_dir, Placement.for_settings("cpu", "auto",
                                                                    dit_split=ULYSSES_2.name))
    assert ULYSSES_2.name == "ulysses2" and ParallelLayout().name == ""
    assert wan.WanTrajectory(model_dir, Placement.for_settings(
        "cpu", "auto")).fingerprint == lone.fingerprint
    assert split.fingerprint != lone.fingerprint
    assert split.decoder_fingerprint == lone.decoder_fingerprint


# --- a group of two ranks serving requests ---------------------------------------------------


def _reference_rank(rank: int, port: int, family: str, model_dir: Path,
                    specs: Sequence[GenerationSpec], layout: ParallelLayout, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=layout.ranks, timeout=timedelta(minutes=10))
    pipe = FAMILIES[family].reference(model_dir, CPU)
    layout.enable(pipe.pipe.transformer)  # type: ignore[attr-defined]
    frames = [pipe(spec) for spec in specs]
    if rank == 0:
        np.savez(out, *frames)
    dist.destroy_process_group()


def split_pipeline(model_dir: Path, specs: Sequence[GenerationSpec], layout: ParallelLayout,
                   tmp_path: Path, family: str = "wan") -> list[np.ndarray]:
    """The family's pipeline's frames for each of ``specs``, its transformer split by
    ``layout`` over as many gloo ranks (processes this spawns, one thread each)."""
    out = tmp_path / "reference.npz"
    spawn(_reference_rank, args=(free_port("127.0.0.1"), family, model_dir, list(specs),
                                    layout, out), nprocs=layout.ranks)
    with np.load(out) as saved:
        return [saved[f"arr_{i}"] for i in range(len(specs))]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ModelService]:
    with model_service(tmp_path_factory.mktemp("parallel"), model_dir, "parallel",
                       workers={"denoise_parallel": {"ulysses": 2}}) as service:
        yield service


def ranks_of(worker_pid: int) -> list[int]:
    """The other ranks of the group whose rank 0 is ``worker_pid``: the children it spawned
    (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_request_on_a_ulysses_2_group_is_the_pipeline_split_alike(
        group: ModelService, model_dir: Path, tmp_path: Path) -> None:
    specs = [make_spec(prompt="a red fox in the snow", seed=5),
             make_spec(prompt="a small boat on a wide grey sea", seed=6),
             make_spec(prompt="a cat", seed=7)]
    want = split_pipeline(model_dir, specs, ULYSSES_2, tmp_path)
    submit(group.client, specs[0])
    assert np.array_equal(read_frames(group.settings, wait_done(group.client, specs[0])),
                          want[0])
    # Two offered together share forwards on the group, each still the split pipeline's.
    before = batched_forwards(group.client)
    offered_together(group.client, group.pool[Stage.DENOISE][0], specs[1:])
    for spec, frames in zip(specs[1:], want[1:], strict=True):
        assert np.array_equal(read_frames(group.settings, wait_done(group.client, spec)),
                              frames)
    assert batched_forwards(group.client) > before


def test_what_a_split_forward_cannot_run_yet_is_refused_naming_the_field(
        group: ModelService) -> None:
    body = {"prompt": "a fox", "width": 32, "height": 32, "num_frames": 5,
            "num_inference_steps": 4, "output_format": "npy"}
    with serve_api(group.settings, ApiSettings()) as url, httpx.Client(base_url=url) as http:
        cached = http.post("/v1/generate", json={**body, "step_cache": {
            "policy": "first_block", "threshold": 0.2}})
        assert cached.status_code == 422, cached.text
        assert "step_cache.policy" in cached.text and "denoise_parallel" in cached.text, \
            cached.text
        adapted = http.post("/v1/generate", json={**body, "loras": [{"name": "style"}]})
        assert adapted.status_code == 422, adapted.text
        assert "loras" in adapted.text and "denoise_parallel" in adapted.text, adapted.text
        uneven = http.post("/v1/generate", json={**body, "width": 48, "height": 48,
                                                  "num_frames": 9})
        assert uneven.status_code == 422, uneven.text
        assert "27 image tokens" in uneven.text and "width" in uneven.text, uneven.text
        assert http.post("/v1/generate", json=body).status_code == 202


def test_a_rank_killed_mid_request_costs_time_never_the_request(
        group: ModelService, model_dir: Path, tmp_path: Path) -> None:
    spec = make_spec(prompt="a red fox in the rain", seed=9, num_inference_steps=12)
    want = split_pipeline(model_dir, [spec], ULYSSES_2, tmp_path)[0]
    rank_0 = group.pool[Stage.DENOISE][0]
    assert rank_0.pid is not None
    submit(group.client, spec)
    wait_for(group.client, spec, State.DENOISING, min_step=2)
    (follower,) = ranks_of(rank_0.pid)
    os.kill(follower, signal.SIGKILL)
    # The group goes down with its rank; a new one takes the request over.
    wait_until(lambda: not rank_0.alive(), timeout_s=60, what="rank 0 ended with its group")
    group.pool[Stage.DENOISE].append(start_worker(
        group.settings, Stage.DENOISE, Path(group.settings.data_dir), group.client,
        "denoise-parallel-again"))
    record = wait_done(group.client, spec)
    assert record.state is State.DONE
    assert np.array_equal(read_frames(group.settings, record), want)


def test_a_request_parked_on_a_group_resumes_there_bit_identically(
        group: ModelService, model_dir: Path, tmp_path: Path) -> None:
    """Preemption on a group: parked at a step boundary (rank 0 checkpoints, every rank
    stays in step), then resumed from that checkpoint on the same group's split forwards."""
    spec = make_spec(prompt="a heron by a still lake", seed=13, num_inference_steps=16)
    want = split_pipeline(model_dir, [spec], ULYSSES_2, tmp_path)[0]
    submit(group.client, spec)
    rank_0, running = stop_owner_when(
        group.client, spec, Stage.DENOISE, group.pool[Stage.DENOISE],
        lambda f: f.get("state") == State.DENOISING.value and int(f.get("step", 0)) >= 3)
    try:  # asked while rank 0 is stopped mid-job (its other rank waits in a collective)
        assert Lifecycle(group.client).ask_preempt(spec.tenant, spec.request_id,
                                                   PreemptMode.PARK)
    finally:
        assert rank_0.pid is not None
        os.kill(rank_0.pid, signal.SIGCONT)
    parked = wait_for(group.client, spec, State.PREEMPTED)
    assert int(parked["checkpoint_step"]) >= int(running["step"]) >= 3
    stopped = Records(group.client).get(spec.tenant, spec.request_id)
    assert stopped is not None
    Lifecycle(group.client).resume(stopped)
    record = wait_done(group.client, spec)
    assert record.state is State.DONE and rank_0.alive()
    assert record.counter("resumed_from") >= int(parked["checkpoint_step"])
    assert record.counter("preemptions") == 1
    assert np.array_equal(read_frames(group.settings, record), want)


def test_a_qwen_image_request_on_a_ulysses_2_group_is_the_pipeline_split_alike(
        qwen_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # Qwen-Image splits its texts too, of any length: ulysses_anything.
    layout = ParallelLayout(ulysses=2, ulysses_anything=True)
    specs = [make_spec(prompt="a fox", num_frames=1, width=64, height=64, seed=3),
             make_spec(prompt="a red fox in the snow under a grey sky", num_frames=1,
                       width=64, height=64, seed=4),
             make_spec(prompt="a cat", num_frames=1, width=64, height=64, seed=5)]
    want = split_pipeline(qwen_model_dir, specs, layout, tmp_path_factory.mktemp("qwen"),
                          "qwen-image")
    with model_service(tmp_path_factory.mktemp("qwen-parallel"), qwen_model_dir,
                       "qwen-parallel", workers={"denoise_parallel": {
                           "ulysses": 2, "ulysses_anything": True}}) as service:
        submit(service.client, specs[0])
        assert np.array_equal(read_frames(service.settings,
                                          wait_done(service.client, specs[0])), want[0])
        # Texts of two lengths, each in a forward of its own on a split sequence.
        offered_together(service.client, service.pool[Stage.DENOISE][0], specs[1:])
        for spec, frames in zip(specs[1:], want[1:], strict=True):
            assert np.array_equal(read_frames(service.settings,
                                              wait_done(service.client, spec)), frames)


@pytest.fixture(scope="module")
def rows_group(tmp_path_factory: pytest.TempPathFactory,
               model_dir: Path) -> Iterator[ModelService]:
    with model_service(tmp_path_factory.mktemp("rows"), model_dir, "rows",
                       workers={"denoise_parallel": {"rows": 2}}) as service:
        yield service


def test_rows_shared_out_over_two_ranks_are_the_pipeline_on_one_device(
        rows_group: ModelService, pipe: object) -> None:
    specs = [make_spec(prompt="a fox", seed=21), make_spec(prompt="a red fox", seed=22),
             make_spec(prompt="a grey cat on a wall", seed=23)]
    before = batched_forwards(rows_group.client)
    offered_together(rows_group.client, rows_group.pool[Stage.DENOISE][0], specs)
    for spec in specs:
        assert np.array_equal(read_frames(rows_group.settings,
                                          wait_done(rows_group.client, spec)),
                              reference(pipe, spec))
    assert batched_forwards(rows_group.client) > before


def test_a_rows_group_killed_mid_request_resumes_on_one_rank_from_its_checkpoint(
        rows_group: ModelService, pipe: object, tmp_path: Path) -> None:
    # A rows split keeps a lone worker's keys and bits, so a worker of one rank continues
    # the group's checkpoint, and the output is still the pipeline's on one device.
    spec = make_spec(seed=31, num_inference_steps=40, width=64, height=64)
    every = checkpoint_every(spec, rows_group.settings.workers.checkpoint_every)
    submit(rows_group.client, spec)

    def past_second_checkpoint(fields: dict[str, str]) -> bool:
        step, saved = int(fields.get("step", 0)), int(fields.get("checkpoint_step", 0))
        return saved >= 2 * every and step - saved <= every

    denoise = rows_group.pool[Stage.DENOISE]
    victim, fields = stop_owner_when(rows_group.client, spec, Stage.DENOISE, denoise,
                                     past_second_checkpoint)
    saved = int(fields["checkpoint_step"])
    victim.kill()  # rank 0, kill -9: its other rank ends with it
    denoise.remove(victim)
    lone = rows_group.settings.model_copy(update={"workers": rows_group.settings.workers
                                                  .model_copy(update={
                                                      "denoise_parallel":
                                                      DenoiseParallelSettings()})})
    denoise.append(start_worker(lone, Stage.DENOISE, tmp_path, rows_group.client,
                                "denoise-one-rank"))
    record = wait_done(rows_group.client, spec)
    assert record.state is State.DONE
    assert record.counter("resumed_from") >= saved > 0
    assert np.array_equal(read_frames(rows_group.settings, record), reference(pipe, spec))
