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

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES[self]


_CONTENT_TYPES = {OutputFormat.MP4: "video/mp4", OutputFormat.PNG: "image/png",
                  OutputFormat.NPY: "application/octet-stream"}


class Priority(StrEnum):
    """Scheduling class: interactive work is taken first and may preempt batch work."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class CfgMode(StrEnum):
    EXACT = "exact"  # reuse a stored unconditional prediction only for identical inputs
    OFF = "off"  # never look up or store one (same output as EXACT)
    INTERVAL = "interval"  # approximate: compute it every ``interval`` steps, reuse between


@dataclass(frozen=True, slots=True)
class CfgCache:
    """How the denoiser may reuse the unconditional (CFG) branch for one request."""

    mode: CfgMode = CfgMode.EXACT
    interval: int = 1

    def __post_init__(self) -> None:
        if self.mode is CfgMode.INTERVAL and self.interval < 2:
            raise ValueError(f"cfg_cache.interval must be >= 2 in interval mode, "
                             f"got {self.interval}")
        if self.mode is not CfgMode.INTERVAL and self.interval != 1:
            raise ValueError(f"cfg_cache.interval applies to interval mode only, "
                             f"got {self.interval} with mode {self.mode.value}")

    @property
    def approximate(self) -> bool:
        """Whether this mode changes the output (and so the trajectory's hash chain)."""
        return self.mode is CfgMode.INTERVAL

    def fresh_at(self, step: int) -> bool:
        """Whether the unconditional branch is computed (not extrapolated) at ``step``."""
        return self.mode is not CfgMode.INTERVAL or step % self.interval == 0


class StepCachePolicy(StrEnum):
    """Which of diffusers' step-cache hooks skips work between denoising steps (approximate)."""

    OFF = "off"
    FIRST_BLOCK = "first_block"  # the blocks after the first, while its residual barely moves
    TAYLORSEER = "taylorseer"  # attention outputs forecast between full computes
    MAGCACHE = "magcache"  # whole forwards, by magnitude ratios calibrated per model


# The parameters each policy takes, with their defaults. diffusers' are set for 28 to 50 steps;
# at the 20 served here (``bench.quality``): FirstBlockCacheConfig's threshold is raised from
# 0.05, which skips almost nothing, MagCache's from 0.06, which skips a fifth at no change in
# accuracy where 0.24 skips half, and TaylorSeer's interval lowered from 5, which forecasts
# too far; the rest are diffusers' own.
STEP_CACHE_DEFAULTS: dict[StepCachePolicy, dict[str, float | int]] = {
    StepCachePolicy.OFF: {},
    StepCachePolicy.FIRST_BLOCK: {"threshold": 0.2},
    StepCachePolicy.TAYLORSEER: {"interval": 2, "warmup": 3, "max_order": 1},
    StepCachePolicy.MAGCACHE: {"threshold": 0.24, "max_skip": 3},
}
_STEP_CACHE_RANGES: dict[str, tuple[float, float]] = {
    "threshold": (1e-6, 1.0), "interval": (1, 100), "warmup": (0, 1000), "max_order": (1, 4),
    "max_skip": (1, 100),
}


# Why MagCache refuses an image-to-image request that skips the trajectory's first steps.
MAGCACHE_PART_WAY = ("magcache's ratios are one per step of a whole trajectory, and an "
                     "image-to-image request of strength below 1 starts part way (give "
                     "strength 1, or another policy)")


# Why approximate reuse refuses a request with an input image.
IMAGE_NOT_REUSED = ("a request with an input image cannot use it: neighbours are ranked by "
                    "the prompt's effect alone, and what the image's does to the shared steps "
                    "is not calibrated")


@dataclass(frozen=True, slots=True)
class StepCache:
    """A request's step-cache policy with every parameter it takes, defaults filled in, so two
    requests asking for the same thing in different words have the same keys. Build it through
    ``StepCache.create``."""

    policy: StepCachePolicy = StepCachePolicy.OFF
    params: tuple[tuple[str, float | int], ...] = ()  # sorted by name

    def __post_init__(self) -> None:
        names = [name for name, _ in self.params]
        if names != sorted(STEP_CACHE_DEFAULTS[self.policy]):
            raise ValueError(f"step_cache {self.policy.value} takes exactly "
                             f"{sorted(STEP_CACHE_DEFAULTS[self.policy])}, got {names}")
        for name, value in self.params:
            low, high = _STEP_CACHE_RANGES[name]
            if not low <= value <= high:
                raise ValueError(f"step_cache.{name} must be from {low:g} to {high:g}, "
                                 f"got {value}")

    @classmethod
    def create(cls, policy: StepCachePolicy | str = StepCachePolicy.OFF,
               **given: float | int | None) -> StepCache:
        """The policy with ``given`` parameters (None: the default); a parameter the policy
        does not take raises ``ValueError`` naming it."""
        policy = StepCachePolicy(policy)
        defaults = STEP_CACHE_DEFAULTS[policy]
        for name, value in given.items():
            if value is not None and name not in defaults:
                raise ValueError(f"step_cache.{name} does not apply to policy {policy.value}")
        params = {name: _like(default, given.get(name)) for name, default in defaults.items()}
        return cls(policy, tuple(sorted(params.items())))

    @property
    def on(self) -> bool:
        return self.policy is not StepCachePolicy.OFF

    def param(self, name: str) -> float | int:
        return dict(self.params)[name]


def _like(default: float | int, value: float | int | None) -> float | int:
    """``value`` in the type of the parameter's default; the default for None."""
    if value is None:
        return default
    return float(value) if isinstance(default, float) else int(value)


# Adapters and images are named by the xxh3-128 of their content.
_CONTENT_HASH_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class LoraUse:
    """One LoRA adapter a request applies: its content hash and its scale."""

    hash: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not _CONTENT_HASH_RE.fullmatch(self.hash):
            raise ValueError(f"lora hash {self.hash!r} must be 32 lowercase hex digits")


class ReuseMode(StrEnum):
    EXACT = "exact"  # only what this request computes, or an identical request computed
    # May start from a similar prompt's checkpoint: the request is rewritten into "that
    # request's first k steps (its prompt, its seed), then this prompt", keyed as such.
    APPROXIMATE = "approximate"


# A request's default cap on the fraction of its steps another request supplies: the model
# card's table decides how many within it (the shipped table earns up to 0.8 where the prompts
# are nearly the same, README "Approximate reuse across requests").
DEFAULT_MAX_SKIP = 0.8


@dataclass(frozen=True, slots=True)
class Reuse:
    """Whether a request may be rewritten to start from a similar request's checkpoint, and
    how similar that request must be and how many of the steps it may supply at most."""

    mode: ReuseMode = ReuseMode.EXACT
    min_similarity: float = 0.9  # cosine of the prompt vectors, in the model's view
    max_skip: float = DEFAULT_MAX_SKIP  # the largest fraction of the steps another request supplies

    def __post_init__(self) -> None:
        if not 0.0 < self.min_similarity <= 1.0:
            raise ValueError(f"reuse.min_similarity must be in (0, 1], got {self.min_similarity}")
        if not 0.0 <= self.max_skip < 1.0:
            raise ValueError(f"reuse.max_skip must be in [0, 1), got {self.max_skip}")

    @property
    def approximate(self) -> bool:
        return self.mode is ReuseMode.APPROXIMATE


# The default ``strength`` of the diffusers image-to-image pipelines.
DEFAULT_STRENGTH = 0.6


def start_step(steps: int, strength: float) -> int:
    """The step an image-to-image trajectory of ``steps`` starts at: the steps ``strength``
    leaves out, counted as the diffusers pipelines count them (``get_timesteps``)."""
    return int(max(steps - min(steps * strength, steps), 0))


@dataclass(frozen=True, slots=True)
class ImageInput:
    """A request's input image: the hash of its normalised pixels, and for image-to-image
    ``strength``, how far back along the trajectory it is noised (1: from pure noise, yet
    with the image's encoding drawn first, as the pipeline draws it). ``strength`` None: the
    image conditions every step of a trajectory that starts from noise (image-to-video).
    ``mask``, for inpainting, the hash of a mask image (normalised to 8-bit grey, white where
    the prompt repaints): every step puts the rest back to the input image."""

    hash: str
    strength: float | None = DEFAULT_STRENGTH
    mask: str | None = None

    def __post_init__(self) -> None:
        if not _CONTENT_HASH_RE.fullmatch(self.hash):
            raise ValueError(f"image hash {self.hash!r} must be 32 lowercase hex digits")
        if self.strength is not None and not 0.0 < self.strength <= 1.0:
            raise ValueError(f"image.strength must be in (0, 1], got {self.strength}")
        if self.mask is not None and not _CONTENT_HASH_RE.fullmatch(self.mask):
            raise ValueError(f"image.mask {self.mask!r} must be 32 lowercase hex digits")
        if self.mask is not None and self.strength is None:
            raise ValueError("image.mask applies to image-to-image (a strength) only")


@dataclass(frozen=True, slots=True)
class PromptSegment:
    """Prompt, negative prompt and guidance in force for the steps before ``until_step``.

    ``guidance_scale`` None means the request's; a branched request (edit-and-resume) keeps the
    guidance of its prefix and sets its own for the steps it changes.
    """

    prompt: str
    negative_prompt: str
    until_step: int
    guidance_scale: float | None = None


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
    cfg_cache: CfgCache = CfgCache()
    # Applied to the denoiser, sorted by hash: the same set in any order is the same request.
    loras: tuple[LoraUse, ...] = ()
    step_cache: StepCache = StepCache()
    reuse: Reuse = Reuse()
    image: ImageInput | None = None  # image-to-image: the trajectory starts at ``first_step``

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if list(self.loras) != sorted(self.loras, key=lambda lora: lora.hash) or \
                len({lora.hash for lora in self.loras}) != len(self.loras):
            raise ValueError("loras must be distinct and sorted by hash (GenerationSpec.create "
                             "sorts them)")
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
        if self.first_step > 0 and self.step_cache.policy is StepCachePolicy.MAGCACHE:
            raise ValueError(f"step_cache.policy: {MAGCACHE_PART_WAY}")
        if self.image is not None and self.first_step >= self.num_inference_steps:
            raise ValueError(f"image.strength {self.image.strength} leaves no step of "
                             f"{self.num_inference_steps} to run; raise it or the steps")

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
        cfg_cache: CfgCache = CfgCache(),
        loras: tuple[LoraUse, ...] = (),
        step_cache: StepCache = StepCache(),
        reuse: Reuse = Reuse(),
        image: ImageInput | None = None,
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
            cfg_cache=cfg_cache,
            loras=tuple(sorted(loras, key=lambda lora: lora.hash)),
            step_cache=step_cache,
            reuse=reuse,
            image=image,
        )

    @property
    def first_step(self) -> int:
        """The step the trajectory starts at: 0, or for image-to-image the steps its strength
        leaves out (``start_step``)."""
        if self.image is None or self.image.strength is None:
            return 0
        return start_step(self.num_inference_steps, self.image.strength)

    def segment_at(self, step: int) -> PromptSegment:
        """The schedule segment in force at ``step`` (0-based)."""
        if not 0 <= step < self.num_inference_steps:
            raise IndexError(f"step {step} is outside 0..{self.num_inference_steps - 1}")
        return next(s for s in self.schedule if step < s.until_step)

    def branch(self, request_id: str, from_step: int, tail: tuple[PromptSegment, ...], *,
               output_format: OutputFormat | None = None,
               priority: Priority | None = None) -> GenerationSpec:
        """A new request that shares this one's first ``from_step`` steps and then follows
        ``tail`` (edit-and-resume). The prefix keeps its guidance explicitly, so the branch's
        hash chain matches this one's up to ``h(from_step)`` whatever the tail sets."""
        if not self.first_step < from_step < self.num_inference_steps:
            raise ValueError(f"from_step must be from {self.first_step + 1} to "
                             f"{self.num_inference_steps - 1}, got {from_step}")
        if not tail or tail[0].until_step <= from_step:
            raise ValueError(f"the edited schedule must run past step {from_step}")
        prefix: list[PromptSegment] = []
        for segment in self.schedule:
            prefix.append(dataclasses.replace(segment, until_step=min(segment.until_step,
                                                                      from_step),
                                              guidance_scale=self.guidance_of(segment)))
            if segment.until_step >= from_step:
                break
        return dataclasses.replace(self, request_id=request_id, schedule=(*prefix, *tail),
                                   output_format=output_format or self.output_format,
                                   priority=priority or self.priority)

    def step_segments(self) -> list[int]:
        """Index of the schedule segment in force at each step."""
        bounds = [s.until_step for s in self.schedule]
        return [next(n for n, until in enumerate(bounds) if i < until)
                for i in range(self.num_inference_steps)]

    def guidance_of(self, segment: PromptSegment) -> float:
        return self.guidance_scale if segment.guidance_scale is None else segment.guidance_scale

    def guidance_at(self, step: int) -> float:
        return self.guidance_of(self.segment_at(step))

    def segment_uses_cfg(self, segment: PromptSegment) -> bool:
        # Matches diffusers: guidance above 1 runs the unconditional branch.
        return self.guidance_of(segment) > 1.0

    @property
    def uses_cfg(self) -> bool:
        return any(self.segment_uses_cfg(s) for s in self.schedule)


SPEC_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(GenerationSpec))
