"""Prompt schedules and edit-and-resume: from request bodies to canonical specs.

Every refusal is a FieldError naming the field, so a client learns which part of its schedule
or which override to change.
"""

from __future__ import annotations

from admission.body import (
    PREFIX_FIELDS,
    CfgCacheBody,
    Overrides,
    ReuseBody,
    Segment,
    StepCacheBody,
    segment_texts,
)
from keys import (
    CfgCache,
    CfgMode,
    GenerationSpec,
    PromptSegment,
    Reuse,
    ReuseMode,
    StepCache,
    StepCachePolicy,
)
from workers.queue.admission import FieldError, TextLimits, check_texts
from workers.queue.schema import RequestRecord


def segments_from(body: list[Segment], default_negative: str, field: str, after_step: int,
                  steps: int) -> tuple[PromptSegment, ...]:
    """A schedule covering steps ``after_step..steps``, checked segment by segment."""
    bounds = [s.until_step for s in body]
    if bounds != sorted(set(bounds)) or bounds[0] <= after_step:
        raise FieldError(field, f"until_step values must rise strictly from above "
                         f"{after_step}, got {bounds}")
    if bounds[-1] != steps:
        raise FieldError(field, f"the last until_step must be num_inference_steps={steps}, "
                         f"got {bounds[-1]}")
    return tuple(PromptSegment(s.prompt, default_negative if s.negative_prompt is None
                               else s.negative_prompt, s.until_step, s.guidance_scale)
                 for s in body)


def cfg_cache_from(body: CfgCacheBody) -> CfgCache:
    if body.mode is CfgMode.INTERVAL and body.interval is None:
        raise FieldError("cfg_cache.interval", "interval mode needs an interval (2 or more)")
    if body.mode is not CfgMode.INTERVAL and body.interval is not None:
        raise FieldError("cfg_cache.interval", f"applies to interval mode only, not "
                         f"{body.mode.value}")
    return CfgCache(body.mode, body.interval or 1)


def step_cache_from(body: StepCacheBody | None, default: StepCachePolicy,
                    served: frozenset[StepCachePolicy], family: str,
                    withheld: str | None = None, part_way: bool = False) -> StepCache:
    """The request's step cache (``default`` when it names none), refused unless the served
    model can run it. A tenant default the model cannot run is no default: such a request
    never named the field it would be refused for. ``part_way``: the request starts after
    step 0 (image-to-image below strength 1), where MagCache's per-step ratios do not hold,
    so a MagCache default does not apply (``RequestAdmission.image_for`` refuses one asked
    for).
    ``withheld``: why the served model runs no step cache at all for now, if it does not."""
    if body is None and part_way:
        served = served - {StepCachePolicy.MAGCACHE}
    if body is None:
        body = StepCacheBody(policy=default if default in served else StepCachePolicy.OFF)
    try:
        cache = StepCache.create(body.policy, **body.params())
    except ValueError as exc:  # a parameter of another policy: the message names it
        field = str(exc).partition(" ")[0]
        raise FieldError(field, str(exc).partition(" ")[2]) from exc
    if cache.on and withheld:
        raise FieldError("step_cache.policy", withheld)
    if cache.on and cache.policy not in served:
        raise FieldError("step_cache.policy", f"{cache.policy.value} cannot run on the served "
                         f"{family} model; it serves {sorted(p.value for p in served)}")
    return cache


def reuse_from(body: ReuseBody | None, default: ReuseMode, fixed: str | None) -> Reuse:
    """The request's reuse mode (the tenant's ``default`` when it names none). ``fixed`` says
    why the request cannot be rewritten, if it cannot (a prompt schedule says what each step
    conditions on): approximate reuse is then refused when asked for, and a tenant default
    does not apply."""
    if body is None:
        return Reuse(ReuseMode.EXACT if fixed else default)
    if fixed and body.mode is ReuseMode.APPROXIMATE:
        raise FieldError("reuse.mode", f"approximate reuse rewrites a request's prompt; {fixed}")
    return Reuse(body.mode, body.min_similarity, body.max_skip)


def branch_point(record: RequestRecord, from_step: int | None) -> tuple[int, str]:
    """The checkpointed step to branch from (default: the latest) and its store key."""
    checkpoints = record.checkpoints()
    if not checkpoints:
        raise FieldError("request_id", f"request {record.spec.request_id} has no checkpoint "
                         "to branch from")
    step = max(checkpoints) if from_step is None else from_step
    if step not in checkpoints:
        raise FieldError("from_step", f"request {record.spec.request_id} has no checkpoint at "
                         f"step {step}; it has checkpoints at {sorted(checkpoints)}")
    if step >= record.spec.num_inference_steps:
        raise FieldError("from_step", f"must be below num_inference_steps="
                         f"{record.spec.num_inference_steps}: nothing is left to edit")
    return step, checkpoints[step]


def branched_spec(spec: GenerationSpec, request_id: str, from_step: int, overrides: Overrides,
                  limits: TextLimits) -> GenerationSpec:
    """``spec`` with ``overrides`` applied from ``from_step`` on, as a new request."""
    for name in PREFIX_FIELDS:
        if getattr(overrides, name) is not None:
            raise FieldError(f"overrides.{name}", "cannot change on resume: it shapes the "
                             "checkpointed steps; submit a new request instead")
    check_texts((("overrides.prompt", overrides.prompt),
                 ("overrides.negative_prompt", overrides.negative_prompt),
                 *segment_texts("overrides.schedule", overrides.schedule)), limits)
    at = spec.segment_at(from_step)
    negative = at.negative_prompt if overrides.negative_prompt is None \
        else overrides.negative_prompt
    if overrides.schedule is not None:
        if overrides.prompt is not None:
            raise FieldError("overrides.prompt", "give either prompt or schedule (one)")
        tail = segments_from(overrides.schedule, negative, "overrides.schedule", from_step,
                             spec.num_inference_steps)
        if overrides.guidance_scale is not None:
            tail = tuple(s if s.guidance_scale is not None
                         else PromptSegment(s.prompt, s.negative_prompt, s.until_step,
                                            overrides.guidance_scale) for s in tail)
    else:
        tail = (PromptSegment(at.prompt if overrides.prompt is None else overrides.prompt,
                              negative, spec.num_inference_steps,
                              spec.guidance_of(at) if overrides.guidance_scale is None
                              else overrides.guidance_scale),)
    return spec.branch(request_id, from_step, tail, output_format=overrides.output_format,
                       priority=overrides.priority)
