"""Denoise stage: the DiT loop, run one step at a time by this worker.

Reads: the denoise stream; the request record; the condition embeddings named by the job; the
latest cached checkpoint on the request's hash chain, which it resumes from (a crash, a
preemption, or another request with the same trajectory prefix put it there).
Writes: checkpoints behind the loop; unconditional predictions (the exact CFG tier); the final
latents (``latents`` entry of this delivery, read once by decode).
Feeds: the decode stream, with the latents reference and the trajectory's chain head.
Checks cancel and preempt requests at every step boundary (through the progress thread).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cachesvc.codec import TensorSpec
from cachesvc.counters import Event
from cachesvc.output_files import OutputFiles
from cachesvc.settings import WorkerSettings
from cachesvc.tensor_cache import TensorCache
from keys import ChainLink, GenerationSpec, KeyKind, StoreKey, adapted, latents_key
from workers.families.base import Denoiser
from workers.queue.credits import Credits
from workers.queue.messages import LATENTS, Job, RefName, Role, Stage, TensorRef
from workers.queue.runtime import InputLostError, JobContext, Outcome
from workers.queue.schema import Field, KindField, State, checkpoint_field
from workers.queue.scripts import NOTHING, RecordWrite
from workers.stages.adapters import AdapterStats, LoadedAdapters
from workers.stages.checkpoint import Checkpoint, CheckpointError
from workers.stages.guidance import Guidance
from workers.stages.interrupt import BlockInterrupts, StepInterrupted
from workers.stages.trajectory import chain_links, checkpoint_steps
from workers.stages.write_behind import WriteBehind

log = logging.getLogger(__name__)

CREDIT_POLL_S = 0.05
# Each condition the job names: its store key (which keys the chain) and its tensor.
Embeddings = dict[RefName, tuple[StoreKey, torch.Tensor]]


@dataclass
class _Run:
    """One attempt's trajectory state, from where it started to where it stopped."""

    spec: GenerationSpec
    links: list[ChainLink]
    scheduler: Any
    rng: torch.Generator
    latents: torch.Tensor
    step: int
    compute_s: float
    guidance: Guidance

    def checkpoint(self) -> Checkpoint:
        return Checkpoint.capture(self.step, self.latents, self.scheduler, self.rng,
                                  self.guidance.residual, self.compute_s)


class DenoiseHandler:
    stage = Stage.DENOISE

    def __init__(self, cache: TensorCache, model: Denoiser, settings: WorkerSettings,
                 credits: Credits,
                 report_adapters: Callable[[AdapterStats, tuple[str, ...]], None] | None = None,
                 files: OutputFiles | None = None) -> None:
        self.cache = cache
        # Where a checkpoint written as the job stops early (a drain, a preemption) is also
        # kept: the store may live in memory only, and a drain is often followed by a restart
        # of everything, the storage node included.
        self.files = files
        self.model = model
        self.settings = settings
        self.credits = credits
        # The two CFG branches are independent forwards of one model. Run concurrently, each
        # with its own single-threaded kernels, they compute exactly what they compute in turn.
        # The intra-op thread count is per thread: the pool's thread gets this one's, or its
        # kernels split work differently and results differ in the last bits.
        self._cond_pool = (ThreadPoolExecutor(1, "cfg-cond", initializer=torch.set_num_threads,
                                              initargs=(torch.get_num_threads(),))
                           if settings.cfg_parallel else None)
        self._writes = WriteBehind()
        self._interrupts = BlockInterrupts(model.transformer)
        self.adapters = LoadedAdapters(cache, model.transformer, settings.lora_slots,
                                       report_adapters)

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        spec = ctx.spec()
        embeds = self._embeddings(ctx)
        self.adapters.apply(spec.tenant, spec.loras)  # at the job boundary, never mid-step
        run = self._start(ctx, spec, embeds)
        if not self._take_credit(ctx):
            return self._stopped(ctx, run)
        saves = checkpoint_steps(spec, self.settings.checkpoint_every)
        segments = spec.step_segments()
        with self._interrupts.watching(lambda: ctx.should_stop or ctx.preempt is not None):
            while run.step < spec.num_inference_steps:
                if ctx.should_stop or ctx.preempt is not None:
                    return self._stopped(ctx, run)
                try:
                    self._step(run, embeds, segments)
                except StepInterrupted:
                    # Abandoned mid-step: nothing of it was applied, and the checkpoint is
                    # of the last whole step.
                    ctx.progress(RecordWrite({Field.STOPPED_MID_STEP: run.step}))
                    return self._stopped(ctx, run)
                ctx.progress(RecordWrite({Field.STEP: run.step}))
                if run.step in saves:
                    self._save(ctx, run)
        self._writes.drain()
        key = latents_key(spec.tenant, spec.request_id, job.fence_token(ctx.attempt))
        self.cache.put(key, run.latents)
        stored = TensorSpec.of(run.latents)
        head = run.links[-1]
        # The embeddings travel on, so a decode that finds the latents lost can send the
        # request straight back here.
        return Outcome(job.handoff(Stage.DECODE,
                                   (*job.refs, TensorRef.of(LATENTS, str(key), stored.dtype,
                                                            stored.shape)),
                                   chain_index=head.index, chain_head=head.hex,
                                   compute_s=run.compute_s),
                       fields=run.guidance.stats.as_fields())

    def discard(self, outcome: Outcome) -> None:
        """A fenced-out attempt's latents belong to no one: delete them."""
        if outcome.next_job is not None:
            self.cache.remove(StoreKey.parse(outcome.next_job.ref(LATENTS).key))

    # --- the steps of ``handle`` -------------------------------------------------------------

    @staticmethod
    def _step(run: _Run, embeds: Embeddings,
              segments: list[int]) -> None:
        """Advance ``run`` by one denoising step."""
        spec, i = run.spec, run.step
        segment = spec.schedule[segments[i]]
        cond = embeds[RefName(Role.PROMPT, segments[i])][1]
        negative = (embeds[RefName(Role.NEGATIVE, segments[i])]
                    if spec.segment_uses_cfg(segment) else None)
        t = run.scheduler.timesteps[i]
        start = time.perf_counter()
        prediction = run.guidance.predict(i, run.latents, t, cond, negative,
                                          spec.guidance_of(segment))
        run.latents = run.scheduler.step(prediction, t, run.latents, return_dict=False)[0]
        run.compute_s += time.perf_counter() - start
        run.step += 1

    def _embeddings(self, ctx: JobContext) -> Embeddings:
        job = ctx.job
        keys = [StoreKey.parse(r.key) for r in job.refs]
        tensors = self.cache.batch_get(keys, lookup=False)  # a handoff, not reuse
        tensors = [None if t is None else t.to(self.model.device) for t in tensors]
        missing = [r.key for r, t in zip(job.refs, tensors, strict=True) if t is None]
        if missing:
            raise InputLostError(job, KeyKind.EMBEDDING, Job(job.request_id, job.tenant,
                                                        Stage.ENCODE, priority=job.priority),
                            missing)
        return {r.ref_name: (k, t) for r, k, t in zip(job.refs, keys, tensors, strict=True)
                if t is not None}

    def _start(self, ctx: JobContext, spec: GenerationSpec,
               embeds: Embeddings) -> _Run:
        """The trajectory at its latest cached checkpoint, or at step 0."""
        scheduler = self.model.scheduler(spec)
        links = chain_links(spec, {name: key for name, (key, _) in embeds.items()},
                            adapted(self.model.fingerprint, spec.loras),
                            self.model.scheduler_config,
                            scheduler.timesteps)
        found, lookups = self._latest_checkpoint(ctx, links)
        ctx.progress(lookups)
        if found is None:
            latents, rng = self.model.initial_latents(spec)
            run = _Run(spec, links, scheduler, rng, latents, 0, 0.0, self._guidance(spec, None))
        else:
            rng = torch.Generator(device="cpu")
            device = self.model.device
            found.restore(scheduler, rng, device)
            residual = None if found.cfg_residual is None else found.cfg_residual.to(device)
            run = _Run(spec, links, scheduler, rng, found.latents.to(device), found.step,
                       found.compute_s, self._guidance(spec, residual))
            ctx.progress(RecordWrite({
                checkpoint_field(found.step): str(links[found.step].checkpoint_key())}))
        ctx.progress(RecordWrite({Field.STEP: run.step, Field.RESUMED_FROM: run.step}))
        return run

    def _guidance(self, spec: GenerationSpec, residual: torch.Tensor | None) -> Guidance:
        forward = functools.partial(_forward, self.model, spec)
        return Guidance(self.cache, forward, self.model.guide,
                        adapted(self.model.fingerprint, spec.loras), spec,
                        lookup=self.settings.cfg_cache, cond_pool=self._cond_pool,
                        write_behind=self._writes, residual=residual)

    def _latest_checkpoint(self, ctx: JobContext,
                           links: list[ChainLink]) -> tuple[Checkpoint | None, RecordWrite]:
        """The checkpoint furthest along ``links``: one existence round trip for the chain,
        then reads from the end until one is intact. Also the lookups and hits, as counted in
        the cache counters, for the record."""
        keys = [link.checkpoint_key() for link in links[1:]]
        present = [k for k, ok in zip(keys, self.cache.batch_exists(keys), strict=True) if ok]
        if not present and (kept := self._kept_checkpoint(ctx, keys)) is not None:
            return kept, NOTHING
        lookups, hits = 0, 0
        if not present:  # a lookup that found nothing is a miss, or hit rates lie
            self.cache.counters.add_many(ctx.job.tenant, KeyKind.CHECKPOINT,
                                         {Event.LOOKUPS: 1.0, Event.MISSES: 1.0})
            lookups = 1
        found = None
        for key in reversed(present):
            entry = self.cache.get(key)  # a counted lookup: its cost is the compute saved
            lookups += 1
            if entry is None:
                continue  # evicted or expired since the existence check
            hits += 1
            try:
                found = Checkpoint.from_bytes(entry.numpy().tobytes())
                break
            except CheckpointError:
                # Written by an incompatible release: drop it so nobody trips on it again.
                log.warning("request %s: unreadable checkpoint %s removed",
                            ctx.job.request_id, key, exc_info=True)
                self.cache.remove(key)
        return found, RecordWrite(add={KindField.LOOKUPS.of(KeyKind.CHECKPOINT): lookups,
                                       KindField.HITS.of(KeyKind.CHECKPOINT): hits})

    def _kept_checkpoint(self, ctx: JobContext, keys: list[StoreKey]) -> Checkpoint | None:
        """The furthest checkpoint a stop kept on disk, put back in the store; None if there
        is none (or no disk)."""
        if self.files is None:
            return None
        for key in reversed(keys):
            data = self.files.read(key)
            if data is None:
                continue
            try:
                found = Checkpoint.from_bytes(data)
            except CheckpointError:
                log.warning("request %s: unreadable kept checkpoint %s removed",
                            ctx.job.request_id, key, exc_info=True)
                self.files.path(key).unlink(missing_ok=True)
                continue
            log.info("request %s: resuming from the checkpoint kept on disk at step %d",
                     ctx.job.request_id, found.step)
            self._store_checkpoint(key, data, found.compute_s)
            return found
        return None

    def _store_checkpoint(self, key: StoreKey, data: bytes, compute_s: float) -> None:
        self.cache.put(key, torch.frombuffer(bytearray(data), dtype=torch.uint8),
                       cost_s=compute_s)

    def _take_credit(self, ctx: JobContext) -> bool:
        """Wait for a decode credit; False if the job was cancelled or preempted meanwhile."""
        job = ctx.job
        waiting = False
        while not self.credits.acquire(job.tenant, job.request_id, int(time.time() * 1000)):
            if not waiting:
                ctx.progress(RecordWrite({Field.WAITING: "decode credit"}))
                waiting = True
            if ctx.should_stop or ctx.preempt is not None:
                return False
            time.sleep(CREDIT_POLL_S)
        if waiting:
            ctx.progress(RecordWrite({Field.WAITING: ""}))
        return True

    def _save(self, ctx: JobContext, run: _Run, keep: bool = False) -> None:
        """Checkpoint where the run stands, behind the loop; with ``keep``, on disk too."""
        snapshot = run.checkpoint()
        key = run.links[snapshot.step].checkpoint_key()

        def write() -> None:
            data = snapshot.to_bytes()
            if keep and self.files is not None:
                self.files.write(key, data)
            self._store_checkpoint(key, data, snapshot.compute_s)
            ctx.progress(RecordWrite({checkpoint_field(snapshot.step): str(key),
                                      Field.CHECKPOINT_STEP: snapshot.step}))

        self._writes.submit(f"checkpoint {key}", write)

    def _stopped(self, ctx: JobContext, run: _Run) -> Outcome:
        """The loop stopped early: checkpoint where it stands (unless a newer attempt owns the
        request), wait for the write, and report why."""
        if not ctx.stale and run.step > 0:
            self._save(ctx, run, keep=True)
        self._writes.drain()
        fields = run.guidance.stats.as_fields()
        if ctx.preempt is not None and not ctx.should_stop:
            return Outcome(None, fields=fields, preempted=ctx.preempt)
        return Outcome(None, State.CANCELLED, fields)


def _forward(model: Denoiser, spec: GenerationSpec, latents: torch.Tensor, t: torch.Tensor,
             embeds: torch.Tensor) -> torch.Tensor:
    return model.predict(latents, t, embeds, spec)
