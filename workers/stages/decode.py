"""Decode stage: the VAE, frame chunk by frame chunk, into the requested output file.

Reads: the decode stream; the request record; the final latents named by the job.
Writes: the output file (``output`` entry keyed by chain head, decoder and format, with a TTL,
and the same bytes on disk), then deletes the final latents once the result is published.
Feeds: nothing; the request is DONE and the API serves the output. Latents lost from the store
send the request back to denoise, which continues from its latest checkpoint.
"""

from __future__ import annotations

import time

import torch

from cachesvc.output_files import OutputFiles
from cachesvc.tensor_cache import TensorCache
from keys import ChainLink, KeyKind, StoreKey, output_key
from workers.families.base import Decoder
from workers.queue.credits import Credits
from workers.queue.messages import LATENTS, Job, Stage
from workers.queue.record_write import RecordWrite, tally_fields
from workers.queue.runtime import InputLostError, JobContext, Outcome
from workers.queue.schema import Field
from workers.stages.media import encode_frames


class DecodeHandler:
    stage = Stage.DECODE

    def __init__(self, cache: TensorCache, model: Decoder, fps: int,
                 credits: Credits, files: OutputFiles | None) -> None:
        self.cache = cache
        self.model = model
        self.fps = fps
        self.credits = credits
        self.files = files

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        spec = ctx.spec()
        head = ChainLink(job.tenant, job.chain_index, job.chain_head)
        out_key = output_key(head, self.model.fingerprint, spec.output_format.value)
        # Another request may have made the same output since this one's encode probe missed
        # (or this is a redelivery after the output was stored). A lookup either way, counted
        # in the record and the counters alike.
        hit = self.cache.probe(out_key)
        if not hit:
            start = time.perf_counter()
            latents_ref = job.ref(LATENTS)
            latents = self.cache.get(StoreKey.parse(latents_ref.key), lookup=False)
            if latents is None:
                raise InputLostError(job, KeyKind.LATENTS, self._redo(job), [latents_ref.key])
            data = encode_frames(self.model.frames(latents, spec), spec.output_format, self.fps)
            # What an identical request saves: the trajectory's denoising and this decode.
            cost = job.compute_s + time.perf_counter() - start
            if self.files is not None:
                self.files.write(out_key, data)
            self.cache.put(out_key, torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           cost_s=cost)
        # Counted once the outcome is certain: a recompute for lost latents records no lookup.
        ledger = self.cache.ledger(spec.tenant)
        ledger.lookup(KeyKind.OUTPUT, hit)
        return Outcome(None, fields=RecordWrite({Field.OUTPUT_KEY: str(out_key)})
                       | tally_fields(ledger.take()))

    @staticmethod
    def _redo(job: Job) -> Job:
        """The job that makes the latents again: denoise with the same embeddings (from its
        latest checkpoint), or encode for a job written before decode jobs carried them."""
        embeddings = tuple(r for r in job.refs if r.ref_name != LATENTS)
        if not embeddings:
            return Job(job.request_id, job.tenant, Stage.ENCODE, priority=job.priority)
        return job.handoff(Stage.DENOISE, embeddings)

    def after_publish(self, job: Job, outcome: Outcome) -> None:
        """Final latents have one consumer: delete them once the output is published, let go
        of the request's inputs, and hand its decode credit back. Only now: an attempt whose
        result is refused (a stale one) must not release what a live redo still reads."""
        self.cache.remove(StoreKey.parse(job.ref(LATENTS).key))
        self.cache.release_inputs(job.tenant, job.request_id,
                                  [StoreKey.parse(r.key) for r in job.refs])
        self.credits.release(job.tenant, job.request_id)

    def discard(self, outcome: Outcome) -> None:
        """Outputs are content-addressed: a stale attempt wrote the same bytes, if anything."""
