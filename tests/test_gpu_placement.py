"""What a GPU machine gets, decided here without one: one device per worker, keys that name
where denoise runs whatever machine encodes, embeddings cast to the DiT's dtype, timings that
wait for the device, and bootstrap's choices on a machine that reports a GPU."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import torch

from config.settings import ModelSettings, load_settings
from tests.workers_harness import make_spec
from workers.engine import timing
from workers.families import qwen_image, wan, wan_i2v
from workers.families.base import Placement, PlacementError
from workers.launch import device_environ, stage_counts, with_worker_counts
from workers.queue.messages import Stage

ROOT = Path(__file__).resolve().parent.parent
COUNTS = {Stage.ENCODE: 1, Stage.DENOISE: 2, Stage.DECODE: 1}


def devices(model: ModelSettings, gpus: int) -> list[tuple[Stage, dict[str, str]]]:
    return [(stage, env) for stage, _, env in device_environ(model, COUNTS, gpus)]


def test_workers_take_the_visible_gpus_in_turn() -> None:
    # Denoise workers first, one per GPU; the others share them after.
    assert devices(ModelSettings(device="cuda"), 2) == [
        (Stage.ENCODE, {"DIFFCACHE_MODEL__DEVICE": "cuda:0"}),
        (Stage.DENOISE, {"DIFFCACHE_MODEL__DEVICE": "cuda:0"}),
        (Stage.DENOISE, {"DIFFCACHE_MODEL__DEVICE": "cuda:1"}),
        (Stage.DECODE, {"DIFFCACHE_MODEL__DEVICE": "cuda:1"})]
    # Encoders kept on the CPU take no GPU; the rest still share them out.
    split = devices(ModelSettings(device="cuda", encode_device="cpu"), 3)
    assert [env for _, env in split] == [{}, {"DIFFCACHE_MODEL__DEVICE": "cuda:0"},
                                         {"DIFFCACHE_MODEL__DEVICE": "cuda:1"},
                                         {"DIFFCACHE_MODEL__DEVICE": "cuda:2"}]
    # A denoise worker of two ranks takes two devices in a row (rank r on its own plus r).
    groups = device_environ(ModelSettings(device="cuda"), COUNTS, 4, denoise_ranks=2)
    assert [env["DIFFCACHE_MODEL__DEVICE"] for _, _, env in groups] == [
        "cuda:0", "cuda:0", "cuda:2", "cuda:1"]
    # One GPU, a device named outright, or the CPU: the settings stand as they are.
    for model, gpus in [(ModelSettings(device="cuda"), 1), (ModelSettings(device="cuda:1"), 4),
                        (ModelSettings(device="cpu"), 4)]:
        assert all(env == {} for _, env in devices(model, gpus))


def test_the_default_starts_one_denoise_worker_per_gpu_or_per_cpu_core() -> None:
    def denoise(gpus: int, cores: int = 2, **model: str) -> int:
        settings = load_settings(model=model)
        resolved = with_worker_counts(settings, gpus, cores)
        assert resolved.workers.credit_limit == 2 * resolved.workers.max_batch * max(
            1, stage_counts(resolved)[Stage.DENOISE])
        return stage_counts(resolved)[Stage.DENOISE]

    assert denoise(4) == 4 and denoise(4, device="cuda") == 4
    assert denoise(4, device="cuda:2") == 1
    assert denoise(0) == 2 and denoise(4, device="cpu") == 2 and denoise(0, cores=1) == 1
    # A CPU worker of several threads per op takes that many cores; 0 threads takes them all.
    assert with_worker_counts(load_settings(workers={"denoise_threads": 2}), 0,
                              8).workers.denoise_workers == 4
    assert with_worker_counts(load_settings(workers={"denoise_threads": 0}), 0,
                              8).workers.denoise_workers == 1
    # A worker whose forwards split over two ranks counts as two, on GPUs or cores.
    pairs = {"denoise_parallel": {"ulysses": 2}}
    assert with_worker_counts(load_settings(workers=pairs), 4, 8).workers.denoise_workers == 2
    assert with_worker_counts(load_settings(workers=pairs), 0, 8).workers.denoise_workers == 4
    assert with_worker_counts(load_settings(workers=pairs), 0, 1).workers.denoise_workers == 1
    # A count the settings give stands, none included (a node of encode and decode only).
    assert stage_counts(load_settings(workers={"denoise_workers": 0}))[Stage.DENOISE] == 0
    # A count the settings give stands, on any machine.
    assert with_worker_counts(load_settings(workers={"denoise_workers": 3}),
                              8).workers.denoise_workers == 3


def test_a_device_this_machine_lacks_is_refused_naming_the_setting() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(PlacementError, match=r"model\.device is cuda:1"):
        Placement.for_settings("cuda:1", "auto")
    with pytest.raises(PlacementError, match=r"model\.encode_device is cuda"):
        Placement.for_settings("cpu", "auto", "cuda", computes="encoders")
    # An encode worker on the CPU only names the GPU workers' placement: nothing to open.
    named = Placement.for_settings("cuda", "auto", "cpu", computes="encoders")
    assert (named.device.type, named.dit_dtype) == ("cuda", torch.bfloat16)
    assert (named.encoding.device.type, named.encoding.text_dtype) == ("cpu", torch.float32)


@pytest.mark.slow  # builds the test models: seconds
def test_keys_name_where_denoise_runs_not_where_encode_ran(
        model_dir: Path, i2v_model_dir: Path, qwen_model_dir: Path) -> None:
    """A trajectory's and an output's fingerprints are the same on an encode worker on the
    CPU, one on the GPU and the GPU workers themselves (made here without a GPU: a
    fingerprint reads configs and weights, never the device)."""
    gpu = Placement(torch.device("cuda"), torch.bfloat16, torch.bfloat16, torch.float32)
    on_cpu = Placement.for_settings("cuda", "auto", "cpu", computes="encoders")
    for trajectory, directory in [(wan.WanTrajectory, model_dir),
                                  (wan_i2v.WanI2VTrajectory, i2v_model_dir),
                                  (qwen_image.QwenTrajectory, qwen_model_dir)]:
        here, there = trajectory(directory, on_cpu), trajectory(directory, gpu)
        assert here.fingerprint == there.fingerprint
        assert here.decoder_fingerprint == there.decoder_fingerprint
    # An image's encoder is named where it ran, by every worker of the deployment alike
    # (a denoise worker's placement: its GPU, with the encoders on the CPU).
    encode = wan_i2v.WanI2VTrajectory(i2v_model_dir, on_cpu)
    denoise = wan_i2v.WanI2VTrajectory(i2v_model_dir,
                                       dataclasses.replace(gpu, encoders=on_cpu.encoding))
    assert encode.image_fingerprint == denoise.image_fingerprint
    assert encode.image_fingerprint != wan_i2v.WanI2VTrajectory(i2v_model_dir,
                                                                gpu).image_fingerprint


@pytest.mark.slow  # builds the test models: seconds
def test_qwen_takes_embeddings_encoded_in_another_dtype(qwen_model_dir: Path) -> None:
    """Texts encoded on a CPU encode pool come in float32 to a bfloat16 DiT."""
    denoiser = qwen_image.QwenDenoiser(qwen_model_dir, Placement.for_settings("cpu", "bfloat16"))
    spec = make_spec(num_frames=1)
    latents, _ = denoiser.initial_latents(spec)
    embeds = torch.randn(1, 7, denoiser.transformer.config.joint_attention_dim)
    t = denoiser.scheduler(spec).timesteps[0]
    out = denoiser.predict(latents, t, embeds, spec)
    assert torch.equal(out, denoiser.predict(latents, t, embeds.bfloat16(), spec))


def test_timed_spans_wait_for_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    timing.seconds_since(0.0, torch.device("cpu"))
    assert waited == []
    timing.seconds_since(0.0, torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def plan(tmp_path: Path, gpu: bool, torch_version: str, cuda: str,
         mooncakes: str = "-") -> dict[str, str]:
    """``bootstrap.sh --plan`` on a machine faked by ``tmp_path``: an nvidia-smi on PATH that
    lists a GPU or fails, and a venv whose python reports the given torch and Mooncakes."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H100'\n" if gpu else "exit 9\n"))
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\ncat >/dev/null\necho {torch_version} {cuda} {mooncakes}\n")
    for tool in (smi, python):
        tool.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), "--plan"],
                          capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, "VENV": str(venv),
                               "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return dict(line.split(": ", 1) for line in done.stdout.splitlines())


def test_bootstrap_on_a_gpu_machine_replaces_a_cpu_torch_and_other_mooncakes(
        tmp_path: Path) -> None:
    chosen = plan(tmp_path / "a", gpu=True, torch_version="2.13.0+cpu", cuda="none",
                  mooncakes="mooncake-transfer-engine")
    assert chosen["gpu"] == "yes" and "CUDA build of torch 2.13.0" in chosen["torch"]
    assert "remove mooncake-transfer-engine" in chosen["mooncake"]
    assert "torch.cuda.is_available()" in chosen["check"]
    # A CUDA torch of another version is replaced too: the tested one is pinned.
    assert "CUDA build" in plan(tmp_path / "b", True, "2.15.0", "13.0")["torch"]
    assert plan(tmp_path / "c", True, "2.13.0", "13.0")["torch"] == "keep"
    # Without a GPU, a CPU build of the same version stays.
    cpu = plan(tmp_path / "d", gpu=False, torch_version="2.13.0+cpu", cuda="none")
    assert (cpu["gpu"], cpu["torch"], cpu["mooncake"]) == ("no", "keep", "keep")
    assert "CPU build" in plan(tmp_path / "e", False, "none", "none")["torch"]


def test_the_store_wheel_links_nothing_a_gpu_machine_may_lack() -> None:
    """The one Mooncake wheel of every machine: its store module and storage node load
    without a CUDA runtime or an RDMA driver (the CUDA wheels link libcudart.so.12 or .13,
    libcuda.so.1 and libmlx5.so.1, and ship none of them)."""
    import importlib.metadata
    import importlib.util

    assert importlib.metadata.version("mooncake-transfer-engine-non-cuda") == "0.3.13.post1"
    for other in ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(other)
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.origin is not None
    folder = Path(spec.origin).parent
    for binary in ("store.so", "engine.so", "mooncake_client", "mooncake_master"):
        needed = subprocess.run(["readelf", "-d", str(folder / binary)], capture_output=True,
                                text=True, check=True).stdout
        assert not any(lib in needed for lib in ("libcudart", "libcuda.so", "libmlx5")), binary
        linked = subprocess.run(["ldd", str(folder / binary)], capture_output=True, text=True,
                                check=False).stdout
        assert "not found" not in linked, linked
