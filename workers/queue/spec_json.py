"""The canonical request as a record holds it: a ``request`` payload of the one wire style,
read back with validation, never unpickled. Records written before the envelope (version 0,
a hand-written layout) still read, with today's defaults for what they predate."""

from __future__ import annotations

from typing import Any

from cachesvc.wire import UNVERSIONED, Wire
from keys import (
    CfgCache,
    CfgMode,
    GenerationSpec,
    LoraUse,
    OutputFormat,
    Priority,
    PromptSegment,
    Reuse,
    ReuseMode,
    StepCache,
    StepCachePolicy,
)


def _unversioned(d: Any) -> GenerationSpec:
    """Version 0. Records written before per-segment guidance, the CFG cache, LoRA
    adapters, step caches or approximate reuse existed read with their defaults, so requests
    in flight survive an upgrade."""
    mode, interval = d.get("cfg_cache", [CfgMode.EXACT.value, 1])
    policy, params = d.get("step_cache", [StepCachePolicy.OFF.value, {}])
    reuse = d.get("reuse")
    return GenerationSpec(
        request_id=d["request_id"], tenant=d["tenant"],
        schedule=tuple(PromptSegment(p, n, int(u), None if not g or g[0] is None
                                     else float(g[0]))
                       for p, n, u, *g in d["schedule"]),
        width=int(d["width"]), height=int(d["height"]), num_frames=int(d["num_frames"]),
        num_inference_steps=int(d["num_inference_steps"]),
        guidance_scale=float(d["guidance_scale"]), seed=int(d["seed"]),
        output_format=OutputFormat(d["output_format"]), priority=Priority(d["priority"]),
        cfg_cache=CfgCache(CfgMode(mode), int(interval)),
        loras=tuple(LoraUse(h, float(s)) for h, s in d.get("loras", [])),
        step_cache=StepCache.create(policy, **params),
        reuse=Reuse() if reuse is None else Reuse(ReuseMode(reuse[0]), float(reuse[1]),
                                                  float(reuse[2])))


SPEC: Wire[GenerationSpec] = Wire("request", GenerationSpec, version=1,
                                  older={UNVERSIONED: _unversioned})


def spec_to_json(spec: GenerationSpec) -> str:
    return SPEC.encode_str(spec)


def spec_from_json(raw: str | bytes) -> GenerationSpec:
    return SPEC.decode(raw)
