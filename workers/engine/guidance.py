"""Classifier-free guidance for one request, with the two ways to skip the unconditional branch.

A step is planned first (which transformer rows it needs, after the cache is asked), then
finished with those rows' outputs, so the engine can run the rows of many requests together.

Exact tier: the unconditional prediction is stored under H(model, negative-prompt key, timestep,
latent digest) and reused whenever those exact inputs recur, so outputs never change (the
worker asks and feeds it: ``workers/stages/exact_tier.py``). Interval tier (opt-in,
approximate): the branch runs every k steps and the (cond - uncond) residual of the last run
stands in between, as FasterCache's CFG-Cache does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cachesvc.codec import TensorSpec
from cachesvc.counters import Event
from cachesvc.ledger import Ledger
from keys import CfgMode, Fingerprint, GenerationSpec, KeyKind, StoreKey, cfg_key, tensor_digest
from workers.engine.forward_rows import RowAdapters
from workers.engine.hook_state import CachedForward

# (cond, uncond, scale) -> guided prediction, in the family's operation order.
Combine = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class GuidanceStats:
    """Forwards run and skipped during one attempt, written to the request record."""

    forwards: int = 0
    reused: int = 0  # unconditional forwards replaced by the interval residual



@dataclass(frozen=True, slots=True)
class Row:
    """One transformer forward a step needs: a batch-1 slice of each input."""

    latents: torch.Tensor
    timestep: torch.Tensor  # 0-d
    embeds: torch.Tensor
    spec: GenerationSpec  # its geometry: rows of one geometry may share a forward
    # Its run's step-cache state for this forward: its decisions are its own, whoever shares
    # the forward (``row_caches``).
    cached: CachedForward | None = None
    # The image condition its forward takes beside the latents (image-to-video), if any.
    condition: torch.Tensor | None = None
    adapters: RowAdapters = ()  # its run's LoRA adapters, applied to it alone (``row_adapters``)


@dataclass
class StepPlan:
    """What one guided step needs, and what it already has."""

    scale: float
    rows: list[Row]  # the conditional row first, then the unconditional one if it must run
    guided: bool
    uncond: torch.Tensor | None = None  # found in the exact tier
    cfg_key: StoreKey | None = None  # where a computed unconditional row is kept
    # The unconditional row while the exact tier is still to be asked for its output
    # (``ExactTier.look_up``): it joins ``rows`` on a miss.
    asking: Row | None = None
    uncond_skipped: bool = False  # the interval tier stands in for it
    # An unconditional output this step computed, for the exact tier: (its key, the output,
    # the seconds it cost). ``ExactTier.store`` writes a step's entries together.
    computed: tuple[StoreKey, torch.Tensor, float] | None = None


class Guidance:
    """The guided prediction of each step of one request, skipping the unconditional forward
    where the request's CFG mode allows."""

    def __init__(self, combine: Combine, model: Fingerprint, spec: GenerationSpec,
                 ledger: Ledger | None, *, lookup: bool,
                 residual: torch.Tensor | None = None, adapters: RowAdapters = ()) -> None:
        self.ledger = ledger  # the run's: the exact tier's lookups are counted there
        self.adapters = adapters  # every row's: the run's LoRA adapters
        self.combine = combine
        self.model = model
        self.spec = spec
        self.lookup = lookup and spec.cfg_cache.mode is not CfgMode.OFF
        # The interval tier's state: part of every checkpoint, so a resume is bit-exact.
        self.residual = residual
        self.stats = GuidanceStats()
        self._uncond_s = 0.0  # last measured unconditional forward, for "compute saved"

    def plan(self, step: int, latents: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
             negative: tuple[StoreKey, torch.Tensor] | None, scale: float,
             condition: tuple[StoreKey, torch.Tensor] | None = None) -> StepPlan:
        """The rows step ``step`` must compute; ``negative`` is None for steps without CFG;
        ``condition``: the image condition both rows take, where the family takes one."""
        image = None if condition is None else condition[1]
        rows = [Row(latents, t, cond, self.spec, condition=image, adapters=self.adapters)]
        if negative is None:
            return StepPlan(scale, rows, guided=False)
        if self.residual is not None and not self.spec.cfg_cache.fresh_at(step):
            return StepPlan(scale, rows, guided=True, uncond_skipped=True)
        plan = StepPlan(scale, rows, guided=True)
        uncond = Row(latents, t, negative[1], self.spec, condition=image,
                     adapters=self.adapters)
        if not self.lookup:
            rows.append(uncond)
            return plan
        # The exact bytes, whatever the device and dtype (bfloat16 has no numpy type).
        raw = latents.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        digest = tensor_digest(raw.data, TensorSpec.of(latents).dtype, tuple(latents.shape))
        plan.cfg_key = cfg_key(self.spec.tenant, self.model, negative[0], float(t), digest,
                               None if condition is None else condition[0])
        plan.asking = uncond
        return plan

    def answer(self, plan: StepPlan, found: torch.Tensor | None) -> None:
        """What the exact tier holds for ``plan``'s unconditional row: its output, or None
        (the row then runs)."""
        assert plan.asking is not None
        if found is None:
            plan.rows.append(plan.asking)
        else:
            plan.uncond = found.to(plan.asking.latents.device)
        plan.asking = None

    def finish(self, plan: StepPlan, outputs: Sequence[torch.Tensor],
               seconds: Sequence[float]) -> torch.Tensor:
        """The guided prediction, from the outputs of ``plan.rows`` (and the seconds each
        row's forward cost)."""
        prediction = outputs[0]
        self.stats.forwards += len(outputs)
        if not plan.guided:
            return prediction
        if plan.uncond_skipped:
            assert self.residual is not None
            self.stats.reused += 1
            if self.ledger is not None:
                self.ledger.count(KeyKind.CFG, {Event.COMPUTE_SECONDS_SAVED: self._uncond_s})
            return self.combine(prediction, prediction - self.residual, plan.scale)
        uncond = plan.uncond
        if uncond is None:
            uncond = outputs[1]
            self._uncond_s = seconds[1]
            if plan.cfg_key is not None:
                plan.computed = (plan.cfg_key, uncond, seconds[1])
        if self.spec.cfg_cache.approximate:
            self.residual = prediction - uncond
        return self.combine(prediction, uncond, plan.scale)
