"""The family registry: the family comes from the settings or the folder's model_index.json,
an unknown pipeline class is a clear error, and weight digests are computed once per folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from bench.service_process import DIFFCACHE, diffcache_environ
from config.settings import ModelSettings
from keys import file_digest
from workers.families import BUILT_IN, UnknownFamilyError, family_of, resolve, wan_i2v
from workers.families.base import (
    CPU,
    MANIFEST,
    Placement,
    PlacementError,
    component_fingerprint,
)
from workers.queue.served_model import (
    MODEL_CARD,
    FamilyLimits,
    ModelCardError,
    RequestDefaults,
    Workflow,
    request_defaults,
)


@pytest.mark.slow  # builds the test models: seconds
def test_the_family_is_read_from_model_index(model_dir: Path, qwen_model_dir: Path) -> None:
    assert family_of(model_dir).name == "wan"
    assert family_of(qwen_model_dir).name == "qwen-image"
    assert resolve("auto", qwen_model_dir, "test").name == "qwen-image"
    with pytest.raises(UnknownFamilyError, match="holds a qwen-image model"):
        resolve("wan", qwen_model_dir, "test")


@pytest.mark.slow  # builds the test models: seconds
@pytest.mark.parametrize(("component", "setting", "value"), [
    ("model_index.json", "boundary_ratio", 0.875), ("model_index.json", "expand_timesteps", True),
    ("transformer/config.json", "image_dim", 1280)])
def test_an_image_to_video_checkpoint_that_takes_another_path_is_refused_naming_it(
        i2v_model_dir: Path, tmp_path: Path, component: str, setting: str,
        value: object) -> None:
    """Wan2.2's two experts, its TI2V first-frame timesteps and Wan2.1's CLIP image embedding
    are paths the stages do not reproduce: such a folder is refused, not served wrongly."""
    assert family_of(i2v_model_dir).name == "wan-i2v"
    wan_i2v.WanI2VTrajectory(i2v_model_dir, CPU)  # the tiny model takes none of them
    folder = tmp_path / "model"
    shutil.copytree(i2v_model_dir, folder)
    config = json.loads((folder / component).read_text())
    (folder / component).write_text(json.dumps(config | {setting: value}))
    with pytest.raises(wan_i2v.UnsupportedCheckpointError, match=setting):
        wan_i2v.WanI2VTrajectory(folder, CPU)


def test_a_folder_to_be_built_gets_the_family_of_its_preset(tmp_path: Path) -> None:
    assert resolve("auto", tmp_path, "shapes").name == "qwen-image"
    assert resolve("auto", tmp_path, "default").name == "wan"
    assert resolve("qwen-image", tmp_path, "test").name == "qwen-image"


def test_an_unknown_pipeline_class_names_itself_and_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UnknownFamilyError) as info:
        resolve("auto", tmp_path, "default")
    message = str(info.value)
    assert "FluxPipeline" in message
    assert all(f.pipeline_class in message for f in BUILT_IN)


@pytest.mark.slow  # builds the test models: seconds
def test_weight_digests_are_kept_in_a_manifest(qwen_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(qwen_model_dir, folder)
    first = component_fingerprint(folder, "vae", torch.float32, CPU.device)
    manifest = json.loads((folder / MANIFEST).read_text())
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    assert manifest["vae/diffusion_pytorch_model.safetensors"]["digest"] == file_digest(weights)
    # Read from the manifest next time: a digest planted there is what the fingerprint uses.
    manifest["vae/diffusion_pytorch_model.safetensors"]["digest"] = "planted"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert component_fingerprint(folder, "vae", torch.float32, CPU.device) != first
    os.utime(weights)  # the file changed: its digest is computed again
    assert component_fingerprint(folder, "vae", torch.float32, CPU.device) == first


@pytest.mark.slow
def test_model_init_builds_a_qwen_image_folder(tmp_path: Path) -> None:
    environ = diffcache_environ()
    done = subprocess.run([*DIFFCACHE, "model", "init", "--family", "qwen-image", "--preset",
                           "test", "--dir", str(tmp_path / "q")], capture_output=True,
                          text=True, env=environ, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert family_of(tmp_path / "q").name == "qwen-image"
    bad = subprocess.run([*DIFFCACHE, "model", "init", "--family", "flux", "--dir",
                          str(tmp_path / "f")], capture_output=True, text=True, env=environ,
                         timeout=300, check=False)
    assert bad.returncode == 2 and "model.family" in bad.stderr
    # `diffcache up` refuses it before it starts anything, naming the registry's families.
    up = subprocess.run([*DIFFCACHE, "up"], capture_output=True, text=True,
                        env={**environ, "DIFFCACHE_MODEL__FAMILY": "flux",
                             "DIFFCACHE_DATA_DIR": str(tmp_path / "up")},
                        timeout=300, check=False)
    assert up.returncode == 2 and "model.family" in up.stderr, up.stderr[-2000:]
    assert all(f.name in up.stderr for f in BUILT_IN)
    assert not (tmp_path / "up" / "logs").exists()  # nothing was started


@pytest.mark.slow  # builds the test models: seconds
def test_placement_follows_the_machine_and_names_the_device_class(
        qwen_model_dir: Path) -> None:
    cpu = Placement.for_settings("auto", "auto")
    if not torch.cuda.is_available():
        assert cpu == CPU
        with pytest.raises(PlacementError, match=r"model\.device is cuda"):
            Placement.for_settings("cuda", "auto")
    assert Placement.for_settings("cpu", "bfloat16").dit_dtype is torch.bfloat16
    assert Placement.for_settings("cpu", "bfloat16").vae_dtype is torch.float32
    # A GPU entry is never served to a CPU worker of the same weights, nor the other way round.
    on_cpu = component_fingerprint(qwen_model_dir, "vae", torch.float32, torch.device("cpu"))
    on_gpu = component_fingerprint(qwen_model_dir, "vae", torch.float32, torch.device("cuda"))
    assert on_cpu != on_gpu


def test_request_defaults_come_from_the_model_card_under_explicit_settings(
        tmp_path: Path) -> None:
    assert request_defaults(ModelSettings(), tmp_path) == RequestDefaults()  # no card
    (tmp_path / MODEL_CARD).write_text(json.dumps(
        {"request_defaults": {"width": 32, "height": 48, "guidance_scale": 4.0}}))
    carded = request_defaults(ModelSettings(), tmp_path)
    assert (carded.width, carded.height, carded.guidance_scale) == (32, 48, 4.0)
    assert carded.num_inference_steps == RequestDefaults().num_inference_steps
    assert request_defaults(ModelSettings(height=64), tmp_path).height == 64
    (tmp_path / MODEL_CARD).write_text(json.dumps({"request_defaults": {"depth": 3}}))
    with pytest.raises(ModelCardError, match=r"diffcache\.json"):
        request_defaults(ModelSettings(), tmp_path)


def test_a_family_declares_only_workflows_its_output_can_take() -> None:
    with pytest.raises(ValueError, match="workflows"):
        FamilyLimits(True, 4, 16, 511, frozenset({Workflow.TEXT_TO_IMAGE}))
    with pytest.raises(ValueError, match="workflows"):
        FamilyLimits(False, 1, 16, 507, frozenset())
    with pytest.raises(ValueError, match="inpainting"):
        FamilyLimits(False, 1, 16, 507, frozenset({Workflow.TEXT_TO_IMAGE, Workflow.INPAINTING}))
    assert all(f.limits.workflows for f in BUILT_IN)
