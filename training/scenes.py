"""The synthetic captioned dataset: one coloured shape on a plain background, drawn with PIL.

Every sample is a pure function of (seed, index), so a training run that resumes at step k
sees exactly the batches it would have seen, and nothing is ever stored. The caption names
every attribute; shortened captions (no size, no position) teach the model the prompts people
actually type, such as "a red circle on a blue background".
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from PIL import Image, ImageDraw

RESOLUTION = 32  # pixels per side of every rendered scene


class Colour(Enum):
    RED = (220, 30, 30)
    GREEN = (30, 170, 50)
    BLUE = (30, 60, 220)
    YELLOW = (240, 220, 30)
    PURPLE = (140, 40, 180)
    ORANGE = (245, 140, 20)
    WHITE = (245, 245, 245)
    BLACK = (15, 15, 15)


class Shape(Enum):
    CIRCLE = "circle"
    SQUARE = "square"
    TRIANGLE = "triangle"


class Size(Enum):
    SMALL = 6  # half the shape's extent, in pixels
    LARGE = 9


class Position(Enum):
    # Where the shape's centre sits, as a share of the side; the caption's words follow.
    CENTER = (0.5, 0.5)
    LEFT = (0.28, 0.5)
    RIGHT = (0.72, 0.5)
    TOP = (0.5, 0.28)
    BOTTOM = (0.5, 0.72)


POSITION_WORDS = {Position.CENTER: "in the center", Position.LEFT: "on the left",
                  Position.RIGHT: "on the right", Position.TOP: "at the top",
                  Position.BOTTOM: "at the bottom"}
# The attributes the yardstick reads back, each with its classes in a fixed order.
ATTRIBUTES: dict[str, tuple[Enum, ...]] = {
    "color": tuple(Colour), "shape": tuple(Shape), "size": tuple(Size),
    "position": tuple(Position), "background": tuple(Colour)}


# The share of training captions written as people write them (``free_phrasings``) rather
# than as the caption is.
FREE_SHARE = 0.5


def vocabulary() -> tuple[str, ...]:
    """Every word a caption can hold, sorted: what the model card says the model knows."""
    words = {"a", "an", "on", "background", "with", *(c.name.lower() for c in Colour),
             *(s.value for s in Shape), *(z.name.lower() for z in Size)}
    for phrase in POSITION_WORDS.values():
        words.update(phrase.split())
    return tuple(sorted(words))


def with_article(phrase: str) -> str:
    """``phrase`` after its indefinite article, as people write it: "an orange", "a red".
    Captions that said "a orange" taught a model that broke on the "an orange" people type."""
    return f"{'an' if phrase[0] in 'aeiou' else 'a'} {phrase}"


@dataclass(frozen=True, slots=True)
class Scene:
    colour: Colour
    shape: Shape
    size: Size
    position: Position
    background: Colour
    jitter: tuple[int, int] = (0, 0)  # pixels the shape is moved off its position's centre

    @property
    def caption(self) -> str:
        """The caption that names every attribute."""
        return self.short_caption(with_size=True, with_position=True)

    def short_caption(self, with_size: bool, with_position: bool) -> str:
        size = f"{self.size.name.lower()} " if with_size else ""
        where = f" {POSITION_WORDS[self.position]}" if with_position else ""
        return (f"{with_article(f'{size}{self.colour.name.lower()}')} {self.shape.value}"
                f"{where} on {with_article(self.background.name.lower())} background")

    def labels(self) -> dict[str, int]:
        """Each attribute's class index, in ``ATTRIBUTES`` order."""
        values = {"color": self.colour, "shape": self.shape, "size": self.size,
                  "position": self.position, "background": self.background}
        return {name: ATTRIBUTES[name].index(values[name]) for name in ATTRIBUTES}

    def render(self) -> Image.Image:
        image = Image.new("RGB", (RESOLUTION, RESOLUTION), self.background.value)
        draw = ImageDraw.Draw(image)
        cx = self.position.value[0] * RESOLUTION + self.jitter[0]
        cy = self.position.value[1] * RESOLUTION + self.jitter[1]
        r = self.size.value
        if self.shape is Shape.CIRCLE:
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=self.colour.value)
        elif self.shape is Shape.SQUARE:
            # As wide as the circle: a square of the circle's area stood out from a small
            # circle by about a pixel per corner, which the VAE did not keep.
            draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=self.colour.value)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)],
                         fill=self.colour.value)
        return image


def scene_at(seed: int, index: int) -> Scene:
    """Sample ``index`` of the dataset named by ``seed``."""
    rng = random.Random(seed * 1_000_003 + index)
    colour, background = rng.sample(tuple(Colour), 2)
    return Scene(colour, rng.choice(tuple(Shape)), rng.choice(tuple(Size)),
                 rng.choice(tuple(Position)), background,
                 (rng.randint(-1, 1), rng.randint(-1, 1)))


def _bare(phrase: str) -> str:
    """``phrase`` without its article: "red circle", as people type it."""
    return phrase.removeprefix("a ").removeprefix("an ")


def free_phrasings(scene: Scene, with_size: bool, with_position: bool) -> list[str]:
    """The ways people write the same short caption, every one naming the same attributes:
    as the caption does; without articles; "on white" for "on a white background";
    comma-separated; and background first."""
    size = f"{scene.size.name.lower()} " if with_size else ""
    where = f" {POSITION_WORDS[scene.position]}" if with_position else ""
    thing = f"{with_article(f'{size}{scene.colour.name.lower()}')} {scene.shape.value}"
    ground = scene.background.name.lower()
    return [
        scene.short_caption(with_size, with_position),
        f"{_bare(thing)}{where} on {ground} background",
        f"{thing}{where} on {ground}",
        f"{_bare(thing)}{where}, {ground} background",
        f"{ground} background with {thing}{where}",
    ]


def free_caption(scene: Scene, seed: int, index: int) -> str:
    """One free phrasing of the scene's full caption, drawn by (seed, index): the set that
    ``bench.quality`` reads the model's outputs of beside the full captions."""
    rng = random.Random(seed * 9_000_011 + index)
    return rng.choice(free_phrasings(scene, with_size=True, with_position=True)[1:])


def training_caption(scene: Scene, seed: int, index: int) -> str:
    """The caption a training step pairs with the scene: the full one, or one that leaves out
    what a person leaves out. A caption leaves out the size only of a large shape (half the
    time) and the position only of a centred one (two times in three), so "a red circle on a
    blue background" means a large centred circle: one picture, where a caption that stood for
    every size and position taught the model to smear them into one blob."""
    rng = random.Random(seed * 7_000_003 + index)
    drop_size, drop_position = rng.random() < 1 / 2, rng.random() < 2 / 3
    with_size = not (drop_size and scene.size is Size.LARGE)
    with_position = not (drop_position and scene.position is Position.CENTER)
    if rng.random() < FREE_SHARE:
        return rng.choice(free_phrasings(scene, with_size, with_position)[1:])
    return scene.short_caption(with_size, with_position)


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """PIL images to a (N, 3, H, W) float batch in [-1, 1], the VAE's range."""
    array = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0
