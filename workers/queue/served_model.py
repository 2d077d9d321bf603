"""Which model a deployment serves, and the request limits of each family, as plain data.

Workers publish the family they loaded to Redis when they start; the API reads it from there
(it never imports model code) to check requests against the family's limits and to name the
model in records, ``/metrics`` and the dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis
from pydantic import TypeAdapter, ValidationError

from keys import GenerationSpec
from keys.names import lora_targets, served_model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FamilyLimits:
    """What a request to this family may ask for, beyond the deployment's own limits."""

    video: bool  # False: one frame only, and no MP4
    frame_multiple: int  # num_frames must be frame_multiple * k + 1 (video families)
    spatial_multiple: int  # width and height: VAE factor times DiT patch size
    max_prompt_tokens: int  # what the text encoder keeps of a prompt, less what it adds

    def cost(self, spec: GenerationSpec) -> int:
        """A request's estimated compute in token-forwards: the DiT's tokens (latent frames
        times patches) times the forwards it runs (a step with CFG runs two)."""
        frames = (spec.num_frames - 1) // self.frame_multiple + 1
        patches = (spec.height // self.spatial_multiple) * (spec.width // self.spatial_multiple)
        forwards = sum(2 if spec.segment_uses_cfg(spec.schedule[seg]) else 1
                       for seg in spec.step_segments())
        return frames * patches * forwards


# One entry per family module in workers/families/.
DEFAULT_FAMILY = "wan"  # what a deployment without a model folder builds and serves
LIMITS = {
    # 512 tokens with the EOS the tokenizer appends.
    "wan": FamilyLimits(video=True, frame_multiple=4, spatial_multiple=16,
                        max_prompt_tokens=511),
    # 512 after the template's system prefix, which ends in five tokens of its own.
    "qwen-image": FamilyLimits(video=False, frame_multiple=1, spatial_multiple=16,
                               max_prompt_tokens=507),
}


@dataclass(frozen=True, slots=True)
class ServedModel:
    family: str
    name: str  # the model folder's name

    @property
    def limits(self) -> FamilyLimits:
        return LIMITS[self.family]


_SERVED: TypeAdapter[ServedModel] = TypeAdapter(ServedModel)


def publish_served(client: redis.Redis, model: ServedModel) -> None:
    client.set(served_model(), _SERVED.dump_json(model))


def read_served(client: redis.Redis) -> ServedModel | None:
    """What the workers last said they serve; None before any worker started."""
    raw = client.get(served_model())
    if raw is None:
        return None
    try:
        found = _SERVED.validate_json(raw)
    except ValidationError:
        log.warning("ignoring an unreadable served-model entry")
        return None
    return found if found.family in LIMITS else None


def publish_lora_targets(client: redis.Redis, linears: Mapping[str, tuple[int, int]]) -> None:
    """The served denoiser's linear layers (name -> (out, in)), which adapters must fit."""
    pipe = client.pipeline()
    pipe.delete(lora_targets())
    if linears:
        pipe.hset(lora_targets(), mapping={k: f"{o},{i}" for k, (o, i) in linears.items()})
    pipe.execute()


def read_lora_targets(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """What denoise workers last published; empty before one started."""
    raw: dict[bytes, bytes] = client.hgetall(lora_targets())  # type: ignore[assignment]
    out: dict[str, tuple[int, int]] = {}
    for name, value in raw.items():
        o, _, i = value.decode().partition(",")
        out[name.decode()] = (int(o), int(i))
    return out
