"""Denoise stage: the DiT loop, run one step at a time by this worker.

Reads: the denoise stream; the request record; the condition embeddings named by the job.
Writes: the final latents (``latents`` entry keyed by request id, read once by decode).
Feeds: the decode stream, with the latents reference and the trajectory's chain head.
Checks the cancel flag at every step boundary (through the progress thread, not the network).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cachesvc.tensor_cache import TensorCache
from keys import GenerationSpec, StoreKey, latents_key
from workers.families.wan import WanDenoiser, guide
from workers.messages import Job, Stage, State, TensorRef
from workers.runtime import JobContext, Outcome, StageError
from workers.trajectory import chain_head, step_segments


class DenoiseHandler:
    stage = Stage.DENOISE

    def __init__(self, cache: TensorCache, model: WanDenoiser,
                 cfg_parallel: bool) -> None:
        self.cache = cache
        self.model = model
        # The two CFG branches are independent forwards of one model. Run concurrently, each
        # with its own single-threaded kernels, they compute exactly what they compute in turn.
        self._cond_pool = ThreadPoolExecutor(1, "cfg-cond") if cfg_parallel else None

    def _embeddings(self, job: Job) -> dict[str, tuple[StoreKey, torch.Tensor]]:
        keys = [StoreKey.parse(r.key) for r in job.refs]
        tensors = self.cache.batch_get(keys, lookup=False)  # a handoff, not reuse
        missing = [r.key for r, t in zip(job.refs, tensors, strict=True) if t is None]
        if missing:
            raise StageError(job, f"condition embeddings missing from the store: {missing}")
        return {r.name: (k, t) for r, k, t in zip(job.refs, keys, tensors, strict=True)
                if t is not None}

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        spec = ctx.spec()
        embeds = self._embeddings(job)
        scheduler = self.model.scheduler(spec.num_inference_steps)
        segments = step_segments(spec)
        head = chain_head(spec, {name: key for name, (key, _) in embeds.items()},
                          self.model.fingerprint, self.model.scheduler_config,
                          scheduler.timesteps)
        key = latents_key(spec.tenant, spec.request_id)
        # A redelivery after the latents were stored but before publishing: nothing to redo.
        if not self.cache.exists(key):
            latents = self._denoise(ctx, spec, scheduler, embeds, segments)
            if latents is None:
                return Outcome(None, State.CANCELLED)
            self.cache.put(key, latents)
        shape = (1, *self.model.latent_shape(spec))
        ref = TensorRef("latents", str(key), "float32", shape)
        return Outcome(Job(job.request_id, job.tenant, Stage.DECODE, (ref,),
                           chain_index=head.index, chain_head=head.hex))

    def _denoise(self, ctx: JobContext, spec: GenerationSpec, scheduler: Any,
                 embeds: dict[str, tuple[StoreKey, torch.Tensor]],
                 segments: list[int]) -> torch.Tensor | None:
        """The step loop; None if the request was cancelled at a step boundary."""
        latents = self.model.initial_latents(spec)
        for i, t in enumerate(scheduler.timesteps):
            if ctx.should_stop:
                return None
            cond = embeds[f"prompt:{segments[i]}"][1]
            if not spec.uses_cfg:
                prediction = self.model.predict(latents, t, cond)
            else:
                negative = embeds[f"negative:{segments[i]}"][1]
                if self._cond_pool is None:
                    prediction = self.model.predict(latents, t, cond)
                    uncond = self.model.predict(latents, t, negative)
                else:
                    pending = self._cond_pool.submit(self.model.predict, latents, t, cond)
                    uncond = self.model.predict(latents, t, negative)
                    prediction = pending.result()
                prediction = guide(prediction, uncond, spec.guidance_scale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            ctx.progress(step=i + 1)
        return latents
