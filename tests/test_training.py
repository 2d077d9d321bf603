"""Training the shapes model: the synthetic scenes are deterministic and say what they show,
and ``diffcache model train`` stopped and resumed from its checkpoint ends with weights that
are bit-identical to an uninterrupted run's (one thread, CPU, float32)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench.service_process import DIFFCACHE, diffcache_environ
from training.checkpoint import PlanError
from training.scenes import (
    POSITION_WORDS,
    RESOLUTION,
    Colour,
    Scene,
    Shape,
    Size,
    free_caption,
    free_phrasings,
    scene_at,
    training_caption,
    vocabulary,
)
from training.scenes import Position as Where
from training.shapes_model import TrainPlan


def test_a_scene_is_a_function_of_seed_and_index() -> None:
    assert scene_at(3, 17) == scene_at(3, 17)
    assert np.array_equal(np.asarray(scene_at(3, 17).render()),
                          np.asarray(scene_at(3, 17).render()))
    assert len({scene_at(3, i) for i in range(50)}) > 40
    assert all(scene_at(3, i).colour is not scene_at(3, i).background for i in range(200))


@pytest.mark.parametrize("where", list(Where))
def test_a_render_shows_what_its_caption_names(where: Where) -> None:
    scene = Scene(Colour.RED, Shape.CIRCLE, Size.LARGE, where, Colour.BLUE)
    pixels = np.asarray(scene.render())
    x, y = (round(v * RESOLUTION) for v in where.value)
    assert tuple(pixels[y, x]) == Colour.RED.value
    assert tuple(pixels[0, 0]) == Colour.BLUE.value or where in (Where.LEFT, Where.TOP)
    for word in ("large", "red", "circle", POSITION_WORDS[where], "blue background"):
        assert word in scene.caption
    assert scene.short_caption(False, False) == "a red circle on a blue background"


def test_a_triangle_covers_less_than_a_square_of_its_size() -> None:
    def covered(shape: Shape) -> int:
        scene = Scene(Colour.WHITE, shape, Size.LARGE, Where.CENTER, Colour.BLACK)
        return int((np.asarray(scene.render())[..., 0] > 128).sum())

    assert covered(Shape.TRIANGLE) < covered(Shape.CIRCLE)
    assert covered(Shape.TRIANGLE) < covered(Shape.SQUARE)


def test_a_small_square_and_circle_differ_by_more_than_a_pixel_per_corner() -> None:
    """At 32x32 a small shape is a few latent cells wide: its shape must show in pixels."""
    def mask(shape: Shape) -> np.ndarray:
        scene = Scene(Colour.WHITE, shape, Size.SMALL, Where.CENTER, Colour.BLACK)
        return np.asarray(scene.render())[..., 0] > 128

    assert int((mask(Shape.SQUARE) ^ mask(Shape.CIRCLE)).sum()) >= 4 * 4


def test_captions_take_the_article_people_write() -> None:
    orange = Scene(Colour.ORANGE, Shape.SQUARE, Size.LARGE, Where.CENTER, Colour.BLACK)
    assert orange.short_caption(False, False) == "an orange square on a black background"
    assert orange.caption.startswith("a large orange square")
    on_orange = Scene(Colour.RED, Shape.CIRCLE, Size.SMALL, Where.LEFT, Colour.ORANGE)
    assert on_orange.caption == "a small red circle on the left on an orange background"


def test_a_training_caption_leaves_out_only_what_defaults_to_the_picture() -> None:
    """No size means large and no position means centred, so a short prompt is one picture."""
    captions = [(scene_at(1, i), training_caption(scene_at(1, i), 1, i)) for i in range(2000)]
    for scene, caption in captions:
        assert (scene.size.name.lower() in caption) or scene.size is Size.LARGE
        assert POSITION_WORDS[scene.position] in caption or scene.position is Where.CENTER
    assert any(caption == scene.short_caption(False, False) for scene, caption in captions)


def test_free_phrasings_name_what_the_caption_names_in_words_the_card_lists() -> None:
    known = set(vocabulary())
    for i in range(300):
        scene = scene_at(3, i)
        for text in free_phrasings(scene, with_size=True, with_position=True):
            words = set(re.findall(r"[a-z]+", text))
            assert {scene.colour.name.lower(), scene.shape.value,
                    scene.background.name.lower(), scene.size.name.lower()} <= words, text
            assert words <= known, text
        assert free_caption(scene, 3, i) in free_phrasings(scene, True, True)[1:]


def test_a_plan_of_an_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="architecture"):
        TrainPlan(architecture="huge")


def train(out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DIFFCACHE, "model", "train", "--out", str(out), "--work", str(work),
         "--architecture", "test", "--vae-steps", "3", "--vae-batch", "4", "--dit-steps", "3",
         "--dit-batch", "4", "--threads", "1", *extra],
        capture_output=True, text=True, env=diffcache_environ(), timeout=300, check=False)


def weights(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.slow  # four training processes: about a minute
def test_training_resumed_from_its_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    straight = train(tmp_path / "a", tmp_path / "work-a")
    assert straight.returncode == 0, straight.stderr[-2000:]
    # Stopped inside the VAE phase, then across the VAE -> DiT boundary, then to the end.
    for _ in range(2):
        stopped = train(tmp_path / "b", tmp_path / "work-b", "--max-steps", "2")
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        assert "stopped" in stopped.stdout and not (tmp_path / "b").exists()
    resumed = train(tmp_path / "b", tmp_path / "work-b")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert set(a) == set(b) == {"text_encoder/model.safetensors",
                                "transformer/diffusion_pytorch_model.safetensors",
                                "vae/diffusion_pytorch_model.safetensors"}
    assert a == b
    dit = "transformer/diffusion_pytorch_model.safetensors"
    trained, untrained = (load_file(d / dit) for d in (tmp_path / "a",
                                                         tmp_path / "work-a" / "untrained"))
    assert any(not torch.equal(trained[k], untrained[k].half()) for k in trained)
    other_plan = train(tmp_path / "c", tmp_path / "work-b", "--seed", "1")
    assert other_plan.returncode == 2 and "seed" in other_plan.stderr
