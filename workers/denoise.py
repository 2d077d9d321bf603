"""Denoise stage: the DiT loop, run one step at a time by this worker.

Reads: the denoise stream; the request record; the condition embeddings named by the job.
Writes: the final latents (``latents`` entry keyed by request id, read once by decode).
Feeds: the decode stream, with the latents reference and the trajectory's chain head.
Checks the cancel flag at every step boundary (through the progress thread, not the network).
"""

from __future__ import annotations

import torch

from cachesvc.tensor_cache import TensorCache
from keys import StepInputs, StoreKey, chain_next, chain_root, latents_key
from workers.families.wan import WanDenoiser, guide
from workers.messages import Job, Stage, State, TensorRef
from workers.records import Records
from workers.runtime import JobContext, Outcome, StageError


class DenoiseHandler:
    stage = Stage.DENOISE

    def __init__(self, cache: TensorCache, records: Records, model: WanDenoiser) -> None:
        self.cache = cache
        self.records = records
        self.model = model

    def _embeddings(self, job: Job) -> dict[str, tuple[StoreKey, torch.Tensor]]:
        keys = [StoreKey.parse(r.key) for r in job.refs]
        tensors = self.cache.batch_get(keys)
        missing = [r.key for r, t in zip(job.refs, tensors, strict=True) if t is None]
        if missing:
            raise StageError(job, f"condition embeddings missing from the store: {missing}")
        return {r.name: (k, t) for r, k, t in zip(job.refs, keys, tensors, strict=True)
                if t is not None}

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        record = self.records.get(job.tenant, job.request_id)
        if record is None:
            raise StageError(job, "request record is missing")
        spec = record.spec
        embeds = self._embeddings(job)
        scheduler = self.model.scheduler(spec.num_inference_steps)
        latents = self.model.initial_latents(spec)
        link = chain_root(spec, self.model.fingerprint, self.model.scheduler_config, "float32")
        bounds = [s.until_step for s in spec.schedule]
        for i, t in enumerate(scheduler.timesteps):
            if ctx.should_stop:
                return Outcome(None, State.CANCELLED, {"step": i})
            segment = next(n for n, until in enumerate(bounds) if i < until)
            cond_key, cond = embeds[f"prompt:{segment}"]
            prediction = self.model.predict(latents, t, cond)
            uncond_key = None
            if spec.uses_cfg:
                uncond_key, uncond = embeds[f"negative:{segment}"]
                prediction = guide(prediction, self.model.predict(latents, t, uncond),
                                   spec.guidance_scale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            link = chain_next(link, StepInputs(float(t), cond_key, uncond_key,
                                               spec.guidance_scale))
            ctx.progress(step=i + 1)
        key = latents_key(spec.tenant, spec.request_id)
        self.cache.put(key, latents)
        ref = TensorRef("latents", str(key), "float32", tuple(latents.shape))
        return Outcome(Job(job.request_id, job.tenant, Stage.DECODE, (ref,),
                           chain_index=link.index, chain_head=link.hex))
