"""The exact tier of classifier-free guidance, for every run of a denoise worker's engine: the
unconditional prediction is stored under H(model, negative-prompt key, timestep, latent
digest) and reused whenever those exact inputs recur, so outputs never change. A step's
lookups go in one round trip before its forwards, and what it computed in one write behind
the loop (the worker's I/O, around the engine's step)."""

from __future__ import annotations

from collections.abc import Sequence

from cachesvc.tensor_cache import TensorCache
from workers.engine.guidance import Guidance, StepPlan
from workers.stages.write_behind import WriteBehind


class ExactTier:
    """The exact tier for every run of an engine: a step's lookups in one round trip, and the
    unconditional outputs the step computed stored in one write behind the loop."""

    def __init__(self, cache: TensorCache, write_behind: WriteBehind) -> None:
        self.cache = cache
        self.write_behind = write_behind

    def look_up(self, plans: Sequence[tuple[Guidance, StepPlan]]) -> None:
        """Answer every plan that asks the tier (``StepPlan.asking``)."""
        asking = [(guidance, plan) for guidance, plan in plans if plan.asking is not None]
        if not asking:
            return
        keys = [plan.cfg_key for _, plan in asking]
        assert all(key is not None for key in keys)
        found = self.cache.lookup_many(keys,  # type: ignore[arg-type]
                                       [guidance.ledger for guidance, _ in asking])
        for (guidance, plan), tensor in zip(asking, found, strict=True):
            guidance.answer(plan, tensor)

    def store(self, plans: Sequence[StepPlan]) -> None:
        """Keep the unconditional outputs the plans computed (``StepPlan.computed``)."""
        entries = [plan.computed for plan in plans if plan.computed is not None]
        if not entries:
            return
        items = [(key, output) for key, output, _ in entries]
        costs = [cost for _, _, cost in entries]
        self.write_behind.submit(f"{len(items)} CFG entries, {items[0][0]} first",
                                 lambda: self.cache.batch_put(items, cost_s=costs))
