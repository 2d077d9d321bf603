"""A request's trajectory before it is computed: the prompt segment of every step, the hash
chain over them and the steps that get a checkpoint. Denoise keys its checkpoints and output by
the chain; encode uses its head to answer a request whose output is already cached."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keys import ChainLink, Fingerprint, GenerationSpec, StepInputs, StoreKey, chain, chain_root
from keys.canonical import Canonical
from workers.queue.messages import RefName, Role


def chain_links(spec: GenerationSpec, embedding_keys: Mapping[RefName, StoreKey],
                model: Fingerprint, scheduler_config: Mapping[str, Canonical],
                timesteps: Sequence[float], mag_ratios: Sequence[float] = (),
                image_encoder: Fingerprint | None = None) -> list[ChainLink]:
    """``h(0)..h(N)`` for ``spec``; ``embedding_keys`` holds each segment's prompt and, for
    segments with guidance, its negative prompt; ``mag_ratios``, the model's MagCache ratios;
    ``image_encoder``, what encodes an input image (``chain_root``)."""
    steps = []
    for t, seg in zip(timesteps, spec.step_segments(), strict=True):
        segment = spec.schedule[seg]
        uncond = (embedding_keys[RefName(Role.NEGATIVE, seg)]
                  if spec.segment_uses_cfg(segment) else None)
        steps.append(StepInputs(float(t), embedding_keys[RefName(Role.PROMPT, seg)], uncond,
                                spec.guidance_of(segment)))
    return chain(chain_root(spec, model, scheduler_config, "float32", mag_ratios,
                            image_encoder), steps)


def chain_head(spec: GenerationSpec, embedding_keys: Mapping[RefName, StoreKey],
               model: Fingerprint, scheduler_config: Mapping[str, Canonical],
               timesteps: Sequence[float], mag_ratios: Sequence[float] = (),
               image_encoder: Fingerprint | None = None) -> ChainLink:
    """``h(N)``: names the finished trajectory, and so its output."""
    return chain_links(spec, embedding_keys, model, scheduler_config, timesteps,
                       mag_ratios, image_encoder)[-1]


def checkpoint_every(spec: GenerationSpec, every: int) -> int:
    """The checkpoint interval in steps; 0 asks for a tenth of the request's steps."""
    return every if every > 0 else max(1, spec.num_inference_steps // 10)


def checkpoint_steps(spec: GenerationSpec, every: int) -> frozenset[int]:
    """Steps after which denoise writes a checkpoint: every ``every`` steps, at each prompt
    switch (where edited schedules branch) and at the end (a redelivery then skips it all)."""
    k = checkpoint_every(spec, every)
    n = spec.num_inference_steps
    return frozenset({*range(k, n + 1, k), *(s.until_step for s in spec.schedule), n})
