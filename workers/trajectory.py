"""A request's trajectory before it is computed: the prompt segment of every step and the hash
chain over them. Denoise keys its checkpoints and output by it; encode uses the chain head to
answer a request whose output is already cached without denoising it again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keys import ChainLink, Fingerprint, GenerationSpec, StepInputs, StoreKey, chain, chain_root
from keys.canonical import Canonical


def step_segments(spec: GenerationSpec) -> list[int]:
    """Index of the schedule segment in force at each step."""
    bounds = [s.until_step for s in spec.schedule]
    return [next(n for n, until in enumerate(bounds) if i < until)
            for i in range(spec.num_inference_steps)]


def chain_head(spec: GenerationSpec, embedding_keys: Mapping[str, StoreKey],
               model: Fingerprint, scheduler_config: Mapping[str, Canonical],
               timesteps: Sequence[float]) -> ChainLink:
    """``h(N)`` for ``spec``; ``embedding_keys`` names keys ``prompt:<i>`` and ``negative:<i>``."""
    steps = [StepInputs(float(t), embedding_keys[f"prompt:{seg}"],
                        embedding_keys[f"negative:{seg}"] if spec.uses_cfg else None,
                        spec.guidance_scale)
             for t, seg in zip(timesteps, step_segments(spec), strict=True)]
    return chain(chain_root(spec, model, scheduler_config, "float32"), steps)[-1]
