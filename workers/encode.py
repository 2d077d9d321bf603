"""Encode stage.

Reads: the encode stream; the request record for its spec.
Writes: one condition embedding per distinct prompt and negative prompt (``embed`` entries,
soft-pinned, shared by every request and tenant-namespaced).
Feeds: the denoise stream, with references named ``prompt:<segment>`` and ``negative:<segment>``.
"""

from __future__ import annotations

from cachesvc.codec import TensorSpec
from cachesvc.tensor_cache import TensorCache
from encoders.text import TextModel, encode_texts
from workers.messages import Job, Stage, TensorRef
from workers.runtime import JobContext, Outcome


class EncodeHandler:
    stage = Stage.ENCODE

    def __init__(self, cache: TensorCache, model: TextModel) -> None:
        self.cache = cache
        self.model = model

    def handle(self, ctx: JobContext) -> Outcome:
        job = ctx.job
        spec = ctx.spec()
        texts = [s.prompt for s in spec.schedule]
        if spec.uses_cfg:
            texts += [s.negative_prompt for s in spec.schedule]
        encoded = encode_texts(self.cache, self.model, spec.tenant, texts)
        refs = []
        for i, segment in enumerate(spec.schedule):
            names = [("prompt", segment.prompt)]
            if spec.uses_cfg:
                names.append(("negative", segment.negative_prompt))
            for role, text in names:
                e = encoded[text]
                spec_ = TensorSpec.of(e.tensor)
                refs.append(TensorRef(f"{role}:{i}", str(e.key), spec_.dtype, spec_.shape))
        hits = sum(e.hit for e in encoded.values())
        return Outcome(Job(job.request_id, job.tenant, Stage.DENOISE, tuple(refs)),
                       fields={"hits:embed": hits, "lookups:embed": len(encoded)})
