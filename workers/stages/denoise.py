"""Denoise stage: how a job becomes a run of the engine, and what a run that leaves hands on.

Reads: the denoise stream; the request record; the condition embeddings named by the job, and
the input image's encoding where it has one (its ``image_latent`` entry: where image-to-image
starts, or what every forward of image-to-video takes), and an inpainting mask's (what every
step keeps of the image); the latest cached
checkpoint on the request's hash chain, which it resumes from (a crash, a
preemption, or another request with the same trajectory prefix put it there).
Writes: checkpoints behind the loop; unconditional predictions (the exact CFG tier); the final
latents (``latents`` entry of this delivery, read once by decode).
Feeds: the decode stream, with the latents reference and the trajectory's chain head.
The engine (``workers/engine``) advances the runs a step at a time and the worker's loop
(``denoise_worker``) does their I/O; cancel and preempt requests are seen at every step
boundary (through each run's progress thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from cachesvc.codec import TensorSpec
from cachesvc.counters import Event
from cachesvc.ledger import Ledger
from cachesvc.output_files import OutputFiles
from cachesvc.tensor_cache import TensorCache
from config.settings import WorkerSettings
from keys import (
    ChainLink,
    GenerationSpec,
    ImageInput,
    KeyKind,
    StoreKey,
    adapted,
    latents_key,
)
from workers.engine.checkpoint import Checkpoint, CheckpointError
from workers.engine.core import DenoiseEngine
from workers.engine.forward_inputs import Ranks
from workers.engine.guidance import Guidance
from workers.engine.hook_state import HookStateError, RunHookState, on_device
from workers.engine.row_caches import RunStepCache, check
from workers.engine.run import AdapterSet, DenoiseRun, Embeddings
from workers.engine.timing import release_memory
from workers.families.base import Denoiser, Inpainting
from workers.queue.credits import Credits
from workers.queue.messages import IMAGE, LATENTS, MASK, Job, Stage, TensorRef
from workers.queue.metrics.step_cache import step_cache_fields
from workers.queue.record_write import RecordWrite, tally_fields
from workers.queue.runtime import InputLostError, JobContext, Outcome
from workers.queue.schema import Field, State, checkpoint_field
from workers.queue.served_model import FamilyLimits, RequestDefaults
from workers.queue.streams import Delivery
from workers.stages.adapters import AdapterStats, LoadedAdapters, row_adapters
from workers.stages.exact_tier import ExactTier
from workers.stages.trajectory import chain_links, checkpoint_steps
from workers.stages.write_behind import WriteBehind

log = logging.getLogger(__name__)


def default_spec(defaults: RequestDefaults, limits: FamilyLimits) -> GenerationSpec:
    """A request at the served model's default geometry, as admission fills one in."""
    return GenerationSpec.create(
        request_id="warm-up", tenant="warm-up", prompt="", width=defaults.width,
        height=defaults.height, num_frames=defaults.frames(limits.video),
        num_inference_steps=defaults.num_inference_steps,
        guidance_scale=defaults.guidance_scale, seed=0,
        # Every request to an image-to-video or editing model names an image (a stand-in
        # here: a warm-up's rows are noise, its condition too).
        image=ImageInput("0" * 32, strength=None) if limits.image_conditions else None)


class DenoiseHandler:
    stage = Stage.DENOISE

    def __init__(self, cache: TensorCache, model: Denoiser, settings: WorkerSettings,
                 credits: Credits,
                 report_adapters: Callable[[AdapterStats, tuple[str, ...]], None] | None = None,
                 files: OutputFiles | None = None, ranks: Ranks | None = None) -> None:
        self.cache = cache
        # Where a checkpoint written as the job stops early (a drain, a preemption) is also
        # kept: the store may live in memory only, and a drain is often followed by a restart
        # of everything, the storage node included.
        self.files = files
        self.model = model
        self.settings = settings
        self.credits = credits
        self._writes = WriteBehind()
        self.ranks = ranks
        self.engine = DenoiseEngine(model, settings.max_batch, settings.max_batch_tokens,
                                    settings.lora_slots, settings.cfg_parallel,
                                    settings.ride_along, ranks)
        # Asked by the worker loop for every run's unconditional row of a step at once.
        self.exact_tier = ExactTier(cache, self._writes)
        self.adapters = LoadedAdapters(cache, model.transformer, settings.lora_slots,
                                       report_adapters)

    def warm_up(self, defaults: RequestDefaults, limits: FamilyLimits) -> None:
        """Prove the engine's batch sizes at the served model's default request geometry, as
        admission fills it in (``DenoiseEngine.warm_up``), before the first job arrives. (An
        editing model's unsized requests take their image's size instead: a geometry first
        met is proven when it arrives.)"""
        if not self.settings.warm_up_s:
            return
        spec = default_spec(defaults, limits)
        start = time.perf_counter()
        try:
            sizes = self.engine.warm_up(spec, self.settings.warm_up_s)
        except torch.OutOfMemoryError:
            # Not even its first rows fit: the worker serves on, proving sizes as they come
            # (a request too large for the device fails alone, naming itself).
            release_memory(self.model.device)
            log.warning("warm-up at %dx%dx%d skipped: out of %s memory", spec.width,
                        spec.height, spec.num_frames, self.model.device)
            return
        log.info("warm-up at %dx%dx%d in %.1f s: batched rows proven exact for %s",
                 spec.width, spec.height, spec.num_frames, time.perf_counter() - start,
                 f"{sizes[0]} to {sizes[-1]} rows" if sizes else "no batch size")

    def start(self, ctx: JobContext, delivery: Delivery) -> DenoiseRun:
        """The job as a run: its embeddings read, at its latest cached checkpoint or its first
        step (0, or where an input image is noised to).
        Its adapters are loaded when the engine takes it in (``load_adapters``)."""
        spec = ctx.spec()
        if self.ranks is not None and (why := self.ranks.refusal(
                spec, self.model.tokens(spec, self.model.condition_shape(spec)))):
            # Admission refuses these; a job queued before the split, or resumed, may not be.
            raise ValueError(f"request {spec.request_id}: {why}")
        embeds = self._embeddings(ctx)
        scheduler = self.model.scheduler(spec)
        links = chain_links(spec, {name: key for name, (key, _) in embeds.items()},
                            adapted(self.model.fingerprint, spec.loras),
                            self.model.scheduler_config,
                            scheduler.timesteps, self.model.mag_ratios,
                            self.model.image_fingerprint)
        ledger = self.cache.ledger(spec.tenant)
        found = self._latest_checkpoint(ctx, links, ledger)
        ctx.progress(tally_fields(ledger.take()))
        saves = frozenset(checkpoint_steps(spec, self.settings.checkpoint_every))
        adapters: AdapterSet = (spec.tenant, tuple(spec.loras)) if spec.loras else ()
        # An input image's encoding either starts the trajectory (image-to-image) or is the
        # condition every forward takes (image-to-video: the family gives its shape).
        image = embeds.get(IMAGE)
        takes_condition = self.model.condition_shape(spec) is not None
        if takes_condition and image is None:
            # Checked here, not in a forward that other runs share.
            raise ValueError(f"request {spec.request_id}: its job names no image condition, "
                             "which every forward of this model takes")
        condition = image if takes_condition else None
        inpainting = self._inpainting(spec, image, embeds.get(MASK))
        if found is None:
            latents, rng = self.model.initial_latents(spec, None if image is None else image[1])
            run = DenoiseRun(ctx, delivery, spec, embeds, links, scheduler, rng, latents,
                             spec.first_step, 0.0, self._guidance(spec, ledger, None), saves,
                             spec.step_segments(),
                             adapters, _step_cache(spec, {}), condition=condition,
                             inpainting=inpainting)
        else:
            rng = torch.Generator(device="cpu")
            device = self.model.device
            self.model.scheduler_fields.restore(scheduler, found.scheduler, device)
            rng.set_state(found.rng)
            residual = None if found.cfg_residual is None else found.cfg_residual.to(device)
            run = DenoiseRun(ctx, delivery, spec, embeds, links, scheduler, rng,
                             found.latents.to(device), found.step, found.compute_s,
                             self._guidance(spec, ledger, residual), saves,
                             spec.step_segments(),
                             adapters, _step_cache(spec, on_device(found.hooks, device)),
                             condition=condition, inpainting=inpainting)
            ctx.progress(RecordWrite({
                checkpoint_field(found.step): str(links[found.step].checkpoint_key())}))
        ctx.progress(RecordWrite({Field.STEP: run.step, Field.RESUMED_FROM: run.step}))
        return run

    def load_adapters(self, run: DenoiseRun, in_use: set[str]) -> None:
        """Load ``run``'s adapters (from the store, once) beside ``in_use``, those of the
        engine's runs, which stay loaded; its rows apply them alone (``row_adapters``)."""
        self.adapters.ensure(run.spec.tenant, run.spec.loras, in_use)
        self.engine.executor.adapters.hook_new_layers()

    def take_credit(self, run: DenoiseRun) -> None:
        """A decode credit for ``run``, without waiting: the engine asks again next turn."""
        job = run.ctx.job
        if self.credits.acquire(job.tenant, job.request_id, int(time.time() * 1000)):
            if run.waited_for_credit:
                run.ctx.progress(RecordWrite({Field.WAITING: ""}))
            run.has_credit = True
        elif not run.waited_for_credit:
            run.ctx.progress(RecordWrite({Field.WAITING: "decode credit"}))
            run.waited_for_credit = True

    def after_step(self, runs: list[DenoiseRun]) -> None:
        """Checkpoint each of ``runs`` whose step just taken is one of its saves: the
        step's checkpoints written together, behind the loop."""
        self._save([run for run in runs if run.step in run.saves])

    def finish(self, run: DenoiseRun) -> Outcome:
        """A run that took its last step: its latents stored, the decode job made."""
        ctx, spec, job = run.ctx, run.spec, run.ctx.job
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
                       fields=self._stats(run))

    def discard(self, outcome: Outcome) -> None:
        """A fenced-out attempt's latents belong to no one: delete them."""
        if outcome.next_job is not None:
            self.cache.remove(StoreKey.parse(outcome.next_job.ref(LATENTS).key))

    # --- how a run starts and stops --------------------------------------------------------

    def _embeddings(self, ctx: JobContext) -> Embeddings:
        job = ctx.job
        keys = [StoreKey.parse(r.key) for r in job.refs]
        tensors = self.cache.batch_get(keys, lookup=False)  # a handoff, not reuse
        tensors = [None if t is None else t.to(self.model.device) for t in tensors]
        missing = [r.key for r, t in zip(job.refs, tensors, strict=True) if t is None]
        if missing:  # text embeddings, or an input image's encoding: encode makes both
            raise InputLostError(job, StoreKey.parse(missing[0]).kind,
                                 Job(job.request_id, job.tenant, Stage.ENCODE,
                                     priority=job.priority), missing)
        return {r.ref_name: (k, t) for r, k, t in zip(job.refs, keys, tensors, strict=True)
                if t is not None}

    def _inpainting(self, spec: GenerationSpec, image: tuple[StoreKey, torch.Tensor] | None,
                    mask: tuple[StoreKey, torch.Tensor] | None) -> Inpainting | None:
        """What each step keeps of the input image, for a request with a mask."""
        if spec.image is None or spec.image.mask is None:
            return None
        if image is None or mask is None:
            raise ValueError(f"request {spec.request_id}: its job names no "
                             f"{'image' if image is None else 'mask'} encoding, which "
                             "inpainting keeps to at every step")
        return self.model.inpainting(spec, image[1], mask[1])

    def _guidance(self, spec: GenerationSpec, ledger: Ledger,
                  residual: torch.Tensor | None) -> Guidance:
        # Under a step cache an unconditional output depends on the run's cache state, not only
        # on the inputs the exact tier's key names: the tier is neither asked nor fed.
        return Guidance(self.model.guide,
                        adapted(self.model.fingerprint, spec.loras), spec, ledger,
                        lookup=self.settings.cfg_cache and not spec.step_cache.on,
                        residual=residual, adapters=row_adapters(spec.loras))

    def _stats(self, run: DenoiseRun) -> RecordWrite:
        """What the attempt computed, and the lookups its ledger counted since the start, for
        the record; the step cache's forwards are lookups of their own kind."""
        shown = [KeyKind.CFG]  # on every attempt's record, 0 when the tier was not asked
        ledger = run.ledger
        assert ledger is not None  # a served run's guidance counts in its ledger
        if (cached := run.step_cache) is not None:
            ledger.count(KeyKind.STEP, {
                Event.LOOKUPS: cached.forwards, Event.HITS: cached.skipped,
                Event.MISSES: cached.forwards - cached.skipped})
            self.cache.counters.add_fields(run.spec.tenant, step_cache_fields(
                cached.cache.policy, cached.forwards - cached.skipped, cached.skipped))
            shown.append(KeyKind.STEP)
        stats = run.guidance.stats  # a request's attempts add up to its total
        computed = RecordWrite(add={Field.FORWARDS: stats.forwards,
                                    Field.CFG_REUSED: stats.reused})
        return computed | tally_fields(ledger.take(), shown)

    def _latest_checkpoint(self, ctx: JobContext, links: list[ChainLink],
                           ledger: Ledger) -> Checkpoint | None:
        """The checkpoint furthest along ``links``: one existence round trip for the chain,
        then reads from the end until one is intact, each a lookup in ``ledger``."""
        keys = [link.checkpoint_key() for link in links[1:]]
        found_at = self.cache.batch_exists(keys)
        present = [k for k, ok in zip(keys, found_at, strict=True) if ok]
        # Those past the furthest one present would each have saved more: a search that
        # missed them, for the lookup log (the read below counts the lookup).
        furthest = max((i for i, ok in enumerate(found_at) if ok), default=-1)
        self.cache.log_missed(keys[furthest + 1:])
        if not present and (kept := self._kept_checkpoint(ctx, keys)) is not None:
            return kept
        if not present:  # a lookup that found nothing is a miss, or hit rates lie
            ledger.lookup(KeyKind.CHECKPOINT, hit=False)
        found = None
        for key in reversed(present):
            # A counted lookup: its cost is the compute saved.
            entry = self.cache.get(key, ledger=ledger)
            if entry is None:
                continue  # evicted or expired since the existence check
            try:
                found = self._readable(entry.numpy().tobytes())
                break
            except CheckpointError:
                # Written by an incompatible release: drop it so nobody trips on it again.
                log.warning("request %s: unreadable checkpoint %s removed",
                            ctx.job.request_id, key, exc_info=True)
                self.cache.remove(key)
        return found

    def _readable(self, data: bytes) -> Checkpoint:
        """A stored checkpoint, CheckpointError unless this model's scheduler keeps what it
        holds (one written under another scheduler or diffusers is dropped, not retried)."""
        found = Checkpoint.from_bytes(data)
        extra = set(found.scheduler) - set(self.model.scheduler_fields.names)
        if extra:
            raise CheckpointError(f"scheduler state {sorted(extra)} is not what this model's "
                                  "scheduler keeps")
        try:
            check(found.hooks)
        except HookStateError as exc:
            raise CheckpointError(f"step-cache state: {exc}") from exc
        return found

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
                found = self._readable(data)
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
        self.cache.put(key, _as_tensor(data), cost_s=compute_s)

    def _save(self, runs: list[DenoiseRun], keep: bool = False) -> None:
        """Checkpoint where the runs stand, behind the loop, in one store write; with
        ``keep``, on disk too."""
        if not runs:
            return
        # Now, before the next step.
        taken = [(run.ctx, run.checkpoint(self.model.scheduler_fields)) for run in runs]
        keys = [run.links[snapshot.step].checkpoint_key()
                for run, (_, snapshot) in zip(runs, taken, strict=True)]

        def write() -> None:
            data = [snapshot.to_bytes() for _, snapshot in taken]
            if keep and self.files is not None:
                for key, blob in zip(keys, data, strict=True):
                    self.files.write(key, blob)
            self.cache.batch_put([(key, _as_tensor(blob)) for key, blob in zip(keys, data,
                                                                                strict=True)],
                                 cost_s=[snapshot.compute_s for _, snapshot in taken])
            for key, (ctx, snapshot) in zip(keys, taken, strict=True):
                ctx.progress(RecordWrite({checkpoint_field(snapshot.step): str(key),
                                          Field.CHECKPOINT_STEP: snapshot.step}))

        self._writes.submit(f"{len(keys)} checkpoint(s), {keys[0]} first", write)

    def stopped(self, run: DenoiseRun) -> Outcome:
        """A run that left early: checkpoint where it stands (unless a newer attempt owns the
        request), wait for the write, and report why."""
        ctx = run.ctx
        if not ctx.stale and run.step > 0:
            self._save([run], keep=True)
        self._writes.drain()
        fields = self._stats(run)
        if ctx.preempt is not None and not ctx.should_stop:
            return Outcome(None, fields=fields, preempted=ctx.preempt)
        return Outcome(None, State.CANCELLED, fields)



def _step_cache(spec: GenerationSpec, state: RunHookState) -> RunStepCache | None:
    return (RunStepCache(spec.step_cache, spec.num_inference_steps, state)
            if spec.step_cache.on else None)


def _as_tensor(data: bytes) -> torch.Tensor:
    """Serialized bytes as the uint8 tensor a store entry holds."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
