"""Classifier-free guidance for one request, with the two ways to skip the unconditional branch.

Exact tier: the unconditional prediction is stored under H(model, negative-prompt key, timestep,
latent digest) and reused whenever those exact inputs recur, so outputs never change.
Interval tier (opt-in, approximate): the branch runs every k steps and the (cond - uncond)
residual of the last run stands in between, as FasterCache's CFG-Cache does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cachesvc.codec import TensorSpec
from cachesvc.counters import Event
from cachesvc.tensor_cache import TensorCache
from keys import CfgMode, Fingerprint, GenerationSpec, KeyKind, StoreKey, cfg_key, tensor_digest
from workers.queue.schema import Field, KindField
from workers.queue.scripts import RecordWrite
from workers.stages.write_behind import WriteBehind

# (latents, timestep, embeddings) -> prediction: one transformer forward.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (cond, uncond, scale) -> guided prediction, in the family's operation order.
Combine = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class GuidanceStats:
    """Forwards run and skipped during one attempt, written to the request record."""

    forwards: int = 0
    lookups: int = 0
    hits: int = 0
    reused: int = 0  # unconditional forwards replaced by the interval residual

    def as_fields(self) -> RecordWrite:
        """Counters, added to the record: a request's attempts sum to its total."""
        return RecordWrite(add={Field.FORWARDS: self.forwards,
                                KindField.LOOKUPS.of(KeyKind.CFG): self.lookups,
                                KindField.HITS.of(KeyKind.CFG): self.hits,
                                Field.CFG_REUSED: self.reused})


class Guidance:
    """The guided prediction of each step of one request, skipping the unconditional forward
    where the request's CFG mode allows."""

    def __init__(self, cache: TensorCache, forward: Forward, combine: Combine,
                 model: Fingerprint, spec: GenerationSpec, *, lookup: bool,
                 cond_pool: ThreadPoolExecutor | None, write_behind: WriteBehind,
                 residual: torch.Tensor | None = None) -> None:
        self.cache = cache
        self.forward = forward
        self.combine = combine
        self.model = model
        self.spec = spec
        self.lookup = lookup and spec.cfg_cache.mode is not CfgMode.OFF
        self.cond_pool = cond_pool
        self.write_behind = write_behind
        # The interval tier's state: part of every checkpoint, so a resume is bit-exact.
        self.residual = residual
        self.stats = GuidanceStats()
        self._uncond_s = 0.0  # last measured unconditional forward, for "compute saved"

    def predict(self, step: int, latents: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
                negative: tuple[StoreKey, torch.Tensor] | None, scale: float) -> torch.Tensor:
        """The guided prediction at ``step``; ``negative`` is None for steps without CFG."""
        if negative is None:
            self.stats.forwards += 1
            return self.forward(latents, t, cond)
        if self.residual is not None and not self.spec.cfg_cache.fresh_at(step):
            self.stats.forwards += 1
            self.stats.reused += 1
            self.cache.counters.add(self.spec.tenant, KeyKind.CFG, Event.COMPUTE_SECONDS_SAVED,
                                    self._uncond_s)
            prediction = self.forward(latents, t, cond)
            return self.combine(prediction, prediction - self.residual, scale)
        pending = self.cond_pool.submit(self.forward, latents, t, cond) if self.cond_pool else None
        try:
            uncond = self._unconditional(latents, t, negative)
        except BaseException:
            if pending is not None:
                pending.exception()  # the other branch stops too: wait, so none outlives us
            raise
        prediction = pending.result() if pending else self.forward(latents, t, cond)
        self.stats.forwards += 1
        if self.spec.cfg_cache.approximate:
            self.residual = prediction - uncond
        return self.combine(prediction, uncond, scale)

    def _unconditional(self, latents: torch.Tensor, t: torch.Tensor,
                       negative: tuple[StoreKey, torch.Tensor]) -> torch.Tensor:
        key = None
        if self.lookup:
            # The exact bytes, whatever the device and dtype (bfloat16 has no numpy type).
            raw = latents.detach().to("cpu").contiguous().view(torch.uint8).numpy()
            digest = tensor_digest(raw.data, TensorSpec.of(latents).dtype, tuple(latents.shape))
            key = cfg_key(self.spec.tenant, self.model, negative[0], float(t), digest)
            self.stats.lookups += 1
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.hits += 1
                return hit.to(latents.device)
        start = time.perf_counter()
        uncond = self.forward(latents, t, negative[1])
        self._uncond_s = time.perf_counter() - start
        self.stats.forwards += 1
        if key is not None:
            stored, cost = key, self._uncond_s
            self.write_behind.submit(f"CFG entry {stored}",
                                     lambda: self.cache.put(stored, uncond, cost_s=cost))
        return uncond
