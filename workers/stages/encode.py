"""Encode stage.

Reads: the encode stream; the request record for its spec.
Writes: one condition embedding per distinct prompt and negative prompt (``embed`` entries,
soft-pinned, shared by every request and tenant-namespaced).
For a request with an input image, also its VAE encoding at the request's geometry
(``image_latent``, soft-pinned, one per image and geometry; an edit's condition depends on the
image alone, one per image), and its inpainting mask at the
latents' size where it has one (``image_mask``); a request whose uploaded image the
store no longer holds fails, saying how to bring it back.
Feeds: the denoise stream, with a typed reference (``RefName``: role and segment) to each;
or nothing, when the request's output is already cached: an identical request (same seed) is
then DONE without denoising. A request in approximate reuse mode may first be rewritten to
start from a similar request's checkpoint (``approximate.py``); every request with one prompt
offers its own to later ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
import torch

from cachesvc.codec import TensorSpec
from cachesvc.ledger import Ledger
from cachesvc.output_files import OutputFiles
from cachesvc.reuse_index import ReuseIndexError
from cachesvc.tensor_cache import TensorCache
from encoders.image import ImageLostError, ImageModel, encode_image, encode_mask
from encoders.text import (
    EncodedText,
    ImageTextModel,
    TextModel,
    encode_texts,
    encode_texts_with_image,
)
from keys import GenerationSpec, KeyKind, StoreKey, adapted, output_key
from workers.families.base import Trajectory
from workers.queue.messages import IMAGE, MASK, RefName, Role, Stage, TensorRef
from workers.queue.metrics.reuse import steps_reused
from workers.queue.record_write import RecordWrite, tally_fields
from workers.queue.runtime import JobContext, Outcome
from workers.queue.schema import Field, State
from workers.queue.spec_json import spec_to_json
from workers.stages.approximate import ApproximateReuse, Rewrite, eligible
from workers.stages.trajectory import chain_head

log = logging.getLogger(__name__)


class EncodeHandler:
    stage = Stage.ENCODE

    def __init__(self, cache: TensorCache, model: TextModel | ImageTextModel,
                 trajectory: Trajectory,
                 files: OutputFiles | None = None,
                 reuse: ApproximateReuse | None = None,
                 images: Callable[[], ImageModel] | None = None) -> None:
        self.cache = cache
        self.model = model
        self.trajectory = trajectory
        self.files = files
        self.reuse = reuse  # None: this worker neither offers nor takes approximate reuse
        # The family's image encoder (its VAE), loaded by the first request with an image;
        # None: the family takes none.
        self.images = images

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        spec = ctx.spec()
        ledger = self.cache.ledger(spec.tenant)
        try:
            encoded = self._encode(spec, ledger)
        except ImageLostError as exc:  # an editing model reads its texts with the image
            return self._image_lost(exc, tally_fields(ledger.take()))
        refs = self._refs(spec, encoded)
        cached = self._cached_output(spec, refs, ledger)
        rewrite = None
        # A request whose own output is cached takes it: approximate reuse never stands in
        # for an exact hit. A model without a table reuses nothing, and looks nothing up.
        reuse = self.reuse
        if cached is None and reuse is not None and reuse.table.rows and eligible(spec):
            rewrite = self._reuse(reuse, spec, encoded, ledger,
                                  first=job.generation == 0 and ctx.attempt == 1)
            if rewrite is not None:
                spec = rewrite.spec
                encoded |= self._encode(spec, ledger, encoded)
                refs = self._refs(spec, encoded)
                cached = self._cached_output(spec, refs, ledger)  # an identical rewrite's
        counts = tally_fields(ledger.take())
        if rewrite is not None:  # the record holds what is computed from now on
            counts = counts | RecordWrite({Field.SPEC: spec_to_json(spec),
                                           **rewrite.hit.fields()})
        if cached is not None:
            return Outcome(None, State.DONE,
                           RecordWrite({Field.OUTPUT_KEY: str(cached)}) | counts)
        if spec.image is not None:  # only now: a cached output needs no image encoded
            try:
                refs.extend(self._image_refs(spec, ledger))
            except ImageLostError as exc:
                return self._image_lost(exc, counts | tally_fields(ledger.take()))
            counts = counts | tally_fields(ledger.take())
        # Until it is done, no sweep evicts what the later stages will read.
        self.cache.hold_inputs(job.tenant, job.request_id, [StoreKey.parse(r.key) for r in refs])
        return Outcome(job.handoff(Stage.DENOISE, tuple(refs)), fields=counts,
                       affinity=tuple(lora.hash for lora in spec.loras))

    @staticmethod
    def _image_lost(exc: ImageLostError, counts: RecordWrite) -> Outcome:
        """No retry brings an upload back; a resume does (the API puts the image back from
        its file first), so the request fails now, saying so."""
        log.warning("%s", exc)
        return Outcome(None, State.FAILED, counts | RecordWrite(
            {Field.ERROR: f"{exc}, or resume the request (POST /v1/resume puts it back)"}))

    def _image_refs(self, spec: GenerationSpec, ledger: Ledger) -> list[TensorRef]:
        """The input image's encoding, and the inpainting mask's where the request has one."""
        if self.images is None:  # the API refuses such a request: a worker of another model
            raise ValueError(f"request {spec.request_id} names an input image, but the "
                             "served family takes none")
        model = self.images()
        encoded = [(IMAGE, encode_image(self.cache, model, spec, ledger))]
        if spec.image is not None and spec.image.mask is not None:
            encoded.append((MASK, encode_mask(self.cache, model, spec, ledger)))
        refs = []
        for name, image in encoded:
            shape = TensorSpec.of(image.tensor)
            refs.append(TensorRef.of(name, str(image.key), shape.dtype, shape.shape))
        return refs

    def _encode(self, spec: GenerationSpec, ledger: Ledger,
                have: dict[str, EncodedText] | None = None) -> dict[str, EncodedText]:
        """Embeddings of the spec's texts but those in ``have``: each text is looked up (and
        counted) once per job, rewritten or not."""
        texts = [s.prompt for s in spec.schedule]
        texts += [s.negative_prompt for s in spec.schedule if spec.segment_uses_cfg(s)]
        texts = [t for t in texts if t not in (have or {})]
        if isinstance(self.model, ImageTextModel):
            return encode_texts_with_image(self.cache, self.model, spec, texts, ledger)
        return encode_texts(self.cache, self.model, spec.tenant, texts, ledger)

    @staticmethod
    def _refs(spec: GenerationSpec, encoded: dict[str, EncodedText]) -> list[TensorRef]:
        refs = []
        for i, segment in enumerate(spec.schedule):
            conditions = [(Role.PROMPT, segment.prompt)]
            if spec.segment_uses_cfg(segment):
                conditions.append((Role.NEGATIVE, segment.negative_prompt))
            for role, text in conditions:
                e = encoded[text]
                shape = TensorSpec.of(e.tensor)
                refs.append(TensorRef.of(RefName(role, i), str(e.key), shape.dtype, shape.shape))
        return refs

    def _reuse(self, reuse: ApproximateReuse, spec: GenerationSpec,
               encoded: dict[str, EncodedText], ledger: Ledger, first: bool) -> Rewrite | None:
        """Look for a similar request to start from (approximate mode), else offer this one
        to later requests (on its first delivery only: a retry offers nothing new). Counted
        as a lookup of its own kind. The index is a cache too: when Redis or the index fails,
        the request runs as written."""
        try:
            bucket = reuse.bucket(spec, encoded)
            vector = reuse.vector(spec, encoded[spec.schedule[0].prompt])
            prompt = encoded[spec.schedule[0].prompt].tensor
            rewrite = (reuse.find(spec, bucket, vector, prompt) if spec.reuse.approximate
                       else None)
            if rewrite is None and first:
                reuse.register(spec, bucket, vector)
        except (redis.RedisError, ReuseIndexError) as exc:
            log.warning("request %s: approximate reuse skipped (%s)", spec.request_id, exc)
            rewrite = None
        if spec.reuse.approximate:
            ledger.lookup(KeyKind.APPROXIMATE, hit=rewrite is not None)
        if rewrite is not None:
            self.cache.counters.add_fields(spec.tenant, steps_reused(rewrite.hit.step))
            # Held from the sweeper from now until denoise has read it. Decode releases only
            # the inputs its job names: this hold goes once the sweeper sees the request ended.
            self.cache.hold_inputs(spec.tenant, spec.request_id, [rewrite.checkpoint])
        return rewrite

    def discard(self, outcome: Outcome) -> None:
        """Embeddings are content-addressed and shared: nothing belongs to one attempt."""

    def _cached_output(self, spec: GenerationSpec, refs: list[TensorRef],
                       ledger: Ledger) -> StoreKey | None:
        """The output entry of this exact trajectory, if another request already made it; its
        lookups counted in ``ledger``."""
        t = self.trajectory
        head = chain_head(spec, {r.ref_name: StoreKey.parse(r.key) for r in refs},
                          adapted(t.fingerprint, spec.loras), t.scheduler_config,
                          t.scheduler(spec).timesteps, t.mag_ratios, t.image_fingerprint)
        key = output_key(head, t.decoder_fingerprint, spec.output_format.value)
        # A counted lookup: a hit counts the compute recorded with the output as saved. The
        # read is one small file, against the seconds of denoising it replaces.
        if self.cache.get(key, ledger=ledger) is not None:
            return key
        # Evicted from the store under memory pressure, but still on disk (durable outputs):
        # present, so put it back for this and every later repeat, and count that lookup too.
        data = self.files.read(key) if self.files is not None else None
        if data is None:
            return None
        self.cache.put(key, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return key if self.cache.contains(key, ledger) else None
