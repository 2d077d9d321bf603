"""Prompts for the approximate-reuse benches: scenes of a held-out dataset seed, each written
the way its caption is, in free phrasings that keep every attribute, with the size or position
left out where the model reads them as implied, and once with its colour changed (a prompt
that must not take the other's colour)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np

from training.classifier import AttributeClassifier
from training.scenes import Colour, Position, Scene, Size, free_phrasings, scene_at

SEED = 700  # the dataset seed of the scenes: neither the model's nor the classifier's


@dataclass(frozen=True, slots=True)
class TracePrompt:
    scene: Scene  # what the prompt asks for: every attribute the classifier reads
    prompt: str
    variant: str  # caption, reworded, dropped or changed


def variants(index: int) -> list[TracePrompt]:
    """Five prompts of scene ``index``: its caption first."""
    scene = scene_at(SEED, index)
    rng = random.Random(SEED * 31 + index)
    reworded = rng.sample(free_phrasings(scene, with_size=True, with_position=True)[1:], 2)
    # What a person leaves out and the model reads as implied: a large shape's size, a
    # centred one's position; else another free phrasing.
    if scene.size is Size.LARGE or scene.position is Position.CENTER:
        dropped = scene.short_caption(with_size=scene.size is not Size.LARGE,
                                      with_position=scene.position is not Position.CENTER)
    else:
        dropped = free_phrasings(scene, with_size=True, with_position=True)[3]
    other = rng.choice([c for c in Colour if c not in (scene.colour, scene.background)])
    changed = dataclasses.replace(scene, colour=other)
    return [TracePrompt(scene, scene.caption, "caption"),
            *(TracePrompt(scene, text, "reworded") for text in reworded),
            TracePrompt(scene, dropped, "dropped"),
            TracePrompt(changed, changed.caption, "changed")]


def correct(classifier: AttributeClassifier, frames: np.ndarray,
            asked: list[Scene]) -> np.ndarray:
    """(N, attributes) booleans: whether each output shows what its prompt asked for."""
    read = classifier.read(frames)
    names = sorted(read)
    wanted = [scene.labels() for scene in asked]
    return np.stack([read[name] == np.array([w[name] for w in wanted]) for name in names],
                    axis=1)
