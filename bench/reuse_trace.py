"""Prompts for the approximate-reuse benches: scenes of a held-out dataset seed, each written
the way its caption is, in free phrasings that keep every attribute, with the size or position
left out where the model reads them as implied, and with one attribute changed (colour,
shape, background, size or position: a prompt that must not take the other's attribute)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from training.classifier import AttributeClassifier
from training.scenes import Colour, Position, Scene, Shape, Size, free_phrasings, scene_at

SEED = 700  # the dataset seed of the scenes: neither the model's nor the classifier's
# The attributes a changed prompt changes, as the classifier names them.
CHANGES = ("color", "shape", "background", "size", "position")
# A prompt that asks for the same attributes as its scene's caption, in other words.
SAME = ("caption", "reworded", "dropped")


@dataclass(frozen=True, slots=True)
class TracePrompt:
    scene: Scene  # what the prompt asks for: every attribute the classifier reads
    prompt: str
    variant: str  # one of SAME, or the attribute of CHANGES it changed


def changed(scene: Scene, attribute: str, rng: random.Random) -> Scene:
    """``scene`` with ``attribute`` another value (the shape never the background's colour)."""
    free = [c for c in Colour if c not in (scene.colour, scene.background)]
    return {"color": lambda: dataclasses.replace(scene, colour=rng.choice(free)),
            "background": lambda: dataclasses.replace(scene, background=rng.choice(free)),
            "shape": lambda: dataclasses.replace(
                scene, shape=rng.choice([s for s in Shape if s is not scene.shape])),
            "size": lambda: dataclasses.replace(
                scene, size=next(s for s in Size if s is not scene.size)),
            "position": lambda: dataclasses.replace(
                scene, position=rng.choice([p for p in Position if p is not scene.position])),
            }[attribute]()


def variants(index: int, changes: Sequence[str] = CHANGES) -> list[TracePrompt]:
    """Scene ``index``'s prompts: its caption first, two rewordings, one with what is implied
    left out, then one with each attribute of ``changes`` changed."""
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
    others = [(attribute, changed(scene, attribute, rng)) for attribute in changes]
    return [TracePrompt(scene, scene.caption, "caption"),
            *(TracePrompt(scene, text, "reworded") for text in reworded),
            TracePrompt(scene, dropped, "dropped"),
            *(TracePrompt(other, other.caption, attribute) for attribute, other in others)]


def rotating_changes(index: int, per_scene: int) -> tuple[str, ...]:
    """The ``per_scene`` attributes scene ``index`` of a trace changes: in turn over the
    scenes, so each attribute is changed equally often."""
    return tuple(CHANGES[(index * per_scene + k) % len(CHANGES)] for k in range(per_scene))


def correct(classifier: AttributeClassifier, frames: np.ndarray,
            asked: list[Scene]) -> np.ndarray:
    """(N, attributes) booleans: whether each output shows what its prompt asked for."""
    read = classifier.read(frames)
    names = sorted(read)
    wanted = [scene.labels() for scene in asked]
    return np.stack([read[name] == np.array([w[name] for w in wanted]) for name in names],
                    axis=1)


def reuse_induced(classifier: AttributeClassifier, rewritten: np.ndarray, exact: np.ndarray,
                  asked: list[Scene]) -> np.ndarray:
    """Per rewritten output: whether it shows an attribute other than asked where the same
    prompt computed exactly from the same seed (the rewrite's, its source's) shows it as
    asked, so that the reused steps, not the seed, decided it."""
    reused_right = correct(classifier, rewritten, asked)
    exact_right = correct(classifier, exact, asked)
    return (exact_right & ~reused_right).any(axis=1)
