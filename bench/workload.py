"""Benchmark workloads: prompts built from words the built-in tokenizer knows, drawn Zipf."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = ["cat", "dog", "horse", "bird", "fish", "child", "woman", "man", "car", "boat",
            "train", "house", "tree", "flower", "mountain", "river", "city", "robot", "dragon",
            "king"]
ACTIONS = ["running", "sleeping", "flying", "swimming", "dancing", "walking", "sitting",
           "standing", "playing", "reading"]
PLACES = ["in the snow", "on the beach", "in a garden", "at night", "in the rain",
          "under the sun", "in a forest", "on a road", "in the city", "by the sea"]
NEGATIVE_PROMPTS = ["blurry, low quality", "dark, noisy", "text, watermark"]


@dataclass(frozen=True, slots=True)
class Draw:
    prompt: str
    negative_prompt: str
    seed: int


def prompt_pool(size: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool: list[str] = []
    while len(pool) < size:
        text = f"a {rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}"
        if text not in pool:
            pool.append(text)
    return pool


def zipf_requests(count: int, pool_size: int = 200, exponent: float = 1.1,
                  seed: int = 0) -> list[Draw]:
    """``count`` requests whose prompts follow Zipf(``exponent``) over ``pool_size`` prompts."""
    rng = random.Random(seed)
    pool = prompt_pool(pool_size, seed)
    weights = [1.0 / (rank ** exponent) for rank in range(1, pool_size + 1)]
    prompts = rng.choices(pool, weights=weights, k=count)
    return [Draw(p, rng.choice(NEGATIVE_PROMPTS), rng.randrange(2**31)) for p in prompts]
