"""Approximate reuse at encode: find an earlier request with a similar prompt in the same
bucket and rewrite this one into "that request's first k steps (its prompt, its seed), then
my prompt". The rewritten request has its own exact hash chain, so every key it reads or
writes names what is really computed; denoise finds the other request's checkpoint at step k
as it finds any shared prefix."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cachesvc.reuse_index import ReuseIndex
from cachesvc.tensor_cache import TensorCache
from encoders.text import EncodedText, PromptView
from keys import (
    GenerationSpec,
    PromptSegment,
    StoreKey,
    adapted,
    chain_root,
    reuse_bucket,
)
from workers.engine.checkpoint import Checkpoint
from workers.families.base import Trajectory
from workers.queue.records import Records
from workers.queue.schema import ApproximateHit
from workers.stages.prompt_view import EffectAt, PromptEffect

CANDIDATES = 8  # nearest requests looked at, most similar first


@dataclass(frozen=True, slots=True)
class ReuseTable:
    """How many steps a similarity earns: rows of (least similarity, fraction of the steps),
    measured per model with the quality yardstick and read from its card."""

    rows: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        similarities = [s for s, _ in self.rows]
        fractions = [f for _, f in self.rows]
        if similarities != sorted(set(similarities)):
            raise ValueError(f"reuse_table similarities must rise strictly: {similarities}")
        # ``ApproximateReuse.find`` stops at the first neighbour too far to earn a step.
        if fractions != sorted(fractions) or any(not 0.0 <= f < 1.0 for f in fractions):
            raise ValueError(f"reuse_table fractions must be in [0, 1) and never fall as "
                             f"the similarity rises: {self.rows}")

    def fraction(self, similarity: float) -> float:
        """The fraction of the steps a neighbour this similar may supply (0: none)."""
        earned = [f for s, f in self.rows if similarity >= s]
        return earned[-1] if earned else 0.0


@dataclass(frozen=True, slots=True)
class Rewrite:
    spec: GenerationSpec  # what the request now computes
    hit: ApproximateHit
    checkpoint: StoreKey  # the source's, at ``hit.step``: where denoise starts


def eligible(spec: GenerationSpec) -> bool:
    """A request with one prompt for every step: a prompt schedule already says what each
    step conditions on, so it is never rewritten (nor a source: see ``register``). A
    request with an input image is neither yet: its prompt vector would need its image."""
    return len(spec.schedule) == 1 and spec.image is None


class Agreement:
    """The check that a reused step is not too late to switch prompts: on the source's own
    latents at that step, the two prompts must pull the prediction alike (their effects'
    cosine at least ``least``, the model card's ``reuse_agreement``). The first prediction
    from shared noise ranks prompts; this reads the trajectory itself, where a changed shape
    or colour the reused steps already drew shows.

    A check's three predictions (the empty prompt's, the source's, this request's) share one
    forward. The source's side of it (the first two) is the same for every request checked
    against that checkpoint, and a popular prompt's rewordings all are: it is kept, up to
    ``KEPT_BYTES``, so a repeated check costs one prediction."""

    KEPT_BYTES = 64 << 20

    def __init__(self, view: PromptEffect, least: float,
                 embed: Callable[[str, str], torch.Tensor]) -> None:
        self.view = view
        self.least = least
        self.embed = embed  # (tenant, text): its embedding, cached
        # By the checkpoint's key, which names its content: one key, one latent. (The encode
        # worker runs one job at a time; this is not shared between threads.)
        self._kept: OrderedDict[StoreKey, EffectAt] = OrderedDict()
        self._kept_bytes = 0

    def holds(self, checkpoint: StoreKey, latents: torch.Tensor, step: int,
              mine: torch.Tensor, source: GenerationSpec, spec: GenerationSpec) -> bool:
        """Whether the prompts agree at ``source``'s checkpoint (its key, and its latents at
        ``step``); ``spec`` (this request's) shares its geometry, steps and scheduler."""
        kept = self._kept.get(checkpoint)
        if kept is not None:
            self._kept.move_to_end(checkpoint)
            return self.view.agreement_with(kept, latents, step, mine, spec) >= self.least
        theirs = self.embed(source.tenant, source.schedule[0].prompt)
        kept, agreement = self.view.check(latents, step, theirs, mine, spec)
        self._keep(checkpoint, kept)
        return agreement >= self.least

    def _keep(self, key: StoreKey, kept: EffectAt) -> None:
        self._kept[key] = kept
        self._kept_bytes += kept.nbytes
        while self._kept_bytes > self.KEPT_BYTES and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= dropped.nbytes


class ApproximateReuse:
    """The encode stage's side of approximate reuse: a request's bucket, its registration and
    the search for a checkpoint to start from."""

    def __init__(self, index: ReuseIndex, records: Records, cache: TensorCache,
                 trajectory: Trajectory, table: ReuseTable, view: PromptView,
                 agreement: Agreement | None = None) -> None:
        self.index = index
        self.records = records
        self.cache = cache
        self.trajectory = trajectory
        self.table = table
        self.view = view  # the table's similarities are measured in this view
        self.agreement = agreement  # None: a step in reach is taken unchecked

    def vector(self, spec: GenerationSpec, prompt: EncodedText) -> np.ndarray:
        return self.view.vector(prompt.tensor, prompt.positions, spec)

    def bucket(self, spec: GenerationSpec, encoded: dict[str, EncodedText]) -> str:
        t = self.trajectory
        segment = spec.schedule[0]
        root = chain_root(dataclasses.replace(spec, seed=0), adapted(t.fingerprint, spec.loras),
                          t.scheduler_config, "float32", t.mag_ratios, t.image_fingerprint)
        uncond = encoded[segment.negative_prompt].key if spec.segment_uses_cfg(segment) else None
        return reuse_bucket(root, uncond, spec.guidance_of(segment), self.view.name)

    def register(self, spec: GenerationSpec, bucket: str, vector: np.ndarray) -> None:
        """Offer this request's checkpoints to later similar ones, whatever its own mode."""
        self.index.register(spec.tenant, bucket, spec.request_id, vector)

    def find(self, spec: GenerationSpec, bucket: str, vector: np.ndarray,
             mine: torch.Tensor) -> Rewrite | None:
        """The rewrite onto the most similar request that still has a checkpoint in reach
        where the prompts still agree (``Agreement``; ``mine``: this request's embedding), or
        None. A neighbour's checkpoints are a cache: one that is gone, or too late to switch
        prompts at, sends the search to an earlier checkpoint, then to the next neighbour. A
        neighbour with this very prompt is passed over: its rewrite would be its own output,
        another seed's image."""
        steps = spec.num_inference_steps
        cap = _steps(spec.reuse.max_skip, steps)
        for near in self.index.nearest(spec.tenant, bucket, vector, CANDIDATES + 1):
            if near.request_id == spec.request_id:
                continue
            if near.similarity < spec.reuse.min_similarity:
                break  # most similar first: the rest are further still
            reach = min(cap, _steps(self.table.fraction(near.similarity), steps))
            if reach < 1:
                break  # a lower similarity never earns more steps
            source = self.records.get(spec.tenant, near.request_id)
            if source is None or not eligible(source.spec) or \
                    source.spec.num_inference_steps != steps or \
                    source.spec.schedule[0].prompt == spec.schedule[0].prompt:
                continue
            agreed = self._furthest_agreed(source.spec, source.checkpoints(), reach, mine, spec)
            if agreed is not None:
                step, checkpoint = agreed
                return Rewrite(rewritten(spec, source.spec, step),
                               ApproximateHit(near.request_id, step, near.similarity),
                               checkpoint)
        return None

    def _furthest_agreed(self, source: GenerationSpec, checkpoints: dict[int, str],
                         reach: int, mine: torch.Tensor,
                         spec: GenerationSpec) -> tuple[int, StoreKey] | None:
        """The furthest of ``source``'s checkpoints within ``reach`` that is stored and, where
        the model checks, where the prompts still agree: its step and key. Not counted as
        checkpoint lookups: denoise counts the one it starts from."""
        steps = sorted((s for s in checkpoints if 0 < s <= reach), reverse=True)
        keys = [StoreKey.parse(checkpoints[s]) for s in steps]
        present = self.cache.batch_exists(keys)
        for step, key, found in zip(steps, keys, present, strict=True):
            if not found:
                continue
            if self.agreement is None:
                return step, key
            data = self.cache.get(key, lookup=False)
            if data is None:
                continue  # gone since it was looked for
            latents = Checkpoint.from_bytes(data.numpy().tobytes()).latents
            if self.agreement.holds(key, latents, step, mine, source, spec):
                return step, key
        return None


def _steps(fraction: float, steps: int) -> int:
    # 0.3 * 20 is 6.000000000000001 and 0.7 * 10 is 7.000000000000001; never round a
    # product just under an integer down past it.
    return math.floor(fraction * steps + 1e-9)


def rewritten(spec: GenerationSpec, source: GenerationSpec, step: int) -> GenerationSpec:
    """``source``'s first ``step`` steps (its prompt, its seed), then ``spec``'s prompt, as
    ``spec``'s request: the monolithic pipeline with the source's seed and a prompt switch at
    ``step`` computes the same."""
    mine = spec.schedule[0]
    tail = (PromptSegment(mine.prompt, mine.negative_prompt, spec.num_inference_steps,
                          spec.guidance_of(mine)),)
    branch = source.branch(spec.request_id, step, tail, output_format=spec.output_format,
                           priority=spec.priority)
    return dataclasses.replace(branch, reuse=spec.reuse)
