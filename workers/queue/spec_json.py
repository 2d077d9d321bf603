"""The canonical request as a record holds it: JSON, read back with validation, never
unpickled. Records written by older versions read with today's defaults."""

from __future__ import annotations

import json

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


def spec_to_json(spec: GenerationSpec) -> str:
    return json.dumps({
        "request_id": spec.request_id, "tenant": spec.tenant,
        "schedule": [[s.prompt, s.negative_prompt, s.until_step, s.guidance_scale]
                     for s in spec.schedule],
        "width": spec.width, "height": spec.height, "num_frames": spec.num_frames,
        "num_inference_steps": spec.num_inference_steps,
        "guidance_scale": spec.guidance_scale, "seed": spec.seed,
        "output_format": spec.output_format.value, "priority": spec.priority.value,
        "cfg_cache": [spec.cfg_cache.mode.value, spec.cfg_cache.interval],
        "loras": [[lora.hash, lora.scale] for lora in spec.loras],
        "step_cache": [spec.step_cache.policy.value, dict(spec.step_cache.params)],
        "reuse": [spec.reuse.mode.value, spec.reuse.min_similarity, spec.reuse.max_skip],
    })


def spec_from_json(raw: str | bytes) -> GenerationSpec:
    """The spec a record holds. Records written before per-segment guidance, the CFG cache,
    LoRA adapters, step caches or approximate reuse existed read with their defaults, so
    requests in flight survive an upgrade."""
    d = json.loads(raw)
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
