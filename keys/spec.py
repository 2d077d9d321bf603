"""The canonical generation request that every key is derived from.

The API turns a user's request into a ``GenerationSpec`` once; workers and key builders only
ever see this form. A plain prompt is a one-segment prompt schedule, so the key builders have one
code path for scheduled and unscheduled requests alike.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum

from keys.names import check_tenant

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def valid_request_id(request_id: str) -> bool:
    return bool(_REQUEST_ID_RE.fullmatch(request_id))


class OutputFormat(StrEnum):
    MP4 = "mp4"
    PNG = "png"
    NPY = "npy"


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class PromptSegment:
    """Prompt and negative prompt in force for the steps before ``until_step``."""

    prompt: str
    negative_prompt: str
    until_step: int


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """A validated, canonical generation request. Build it through ``GenerationSpec.create``."""

    request_id: str
    tenant: str
    schedule: tuple[PromptSegment, ...]
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_format: OutputFormat
    priority: Priority

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if not valid_request_id(self.request_id):
            raise ValueError(f"request_id {self.request_id!r} must match {_REQUEST_ID_RE.pattern}")
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if not self.schedule:
            raise ValueError("schedule must hold at least one segment")
        bounds = [s.until_step for s in self.schedule]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"schedule until_step values must rise strictly from >= 1: {bounds}")
        if bounds[-1] != self.num_inference_steps:
            raise ValueError(
                f"the last schedule segment must end at num_inference_steps="
                f"{self.num_inference_steps}, it ends at {bounds[-1]}"
            )

    @classmethod
    def create(
        cls,
        *,
        request_id: str,
        tenant: str,
        prompt: str,
        negative_prompt: str = "",
        width: int,
        height: int,
        num_frames: int,
        num_inference_steps: int,
        guidance_scale: float,
        seed: int,
        output_format: OutputFormat = OutputFormat.MP4,
        priority: Priority = Priority.INTERACTIVE,
        schedule: tuple[PromptSegment, ...] | None = None,
    ) -> GenerationSpec:
        """Build a spec; without ``schedule``, prompt and negative prompt hold for every step."""
        if schedule is None:
            schedule = (PromptSegment(prompt, negative_prompt, num_inference_steps),)
        return cls(
            request_id=request_id,
            tenant=tenant,
            schedule=schedule,
            width=width,
            height=height,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=float(guidance_scale),
            seed=seed,
            output_format=OutputFormat(output_format),
            priority=Priority(priority),
        )

    def segment_at(self, step: int) -> PromptSegment:
        """The schedule segment in force at ``step`` (0-based)."""
        if not 0 <= step < self.num_inference_steps:
            raise IndexError(f"step {step} is outside 0..{self.num_inference_steps - 1}")
        return next(s for s in self.schedule if step < s.until_step)

    @property
    def uses_cfg(self) -> bool:
        # Matches diffusers: guidance above 1 runs the unconditional branch.
        return self.guidance_scale > 1.0


SPEC_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(GenerationSpec))
