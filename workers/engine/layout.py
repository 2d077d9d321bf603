"""How a step's rows of one geometry are laid out in forwards: in forwards of ``max_batch`` rows
on two threads, or all in one forward, whichever this worker measured faster.

Neither is faster everywhere. A small model's forward is mostly Python, so two forwards on two
threads take turns on the interpreter lock and one forward of every row wins (README "What
shares a forward": 63 ms for 16 rows at once against 99 ms for two forwards of 8); a larger
model's kernels release the lock, and two forwards use both cores. Both
layouts give every row the same bits (``rows_apart``, and the engine's proof per batch size),
so the choice costs time only, never exactness.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class Layout(enum.Enum):
    SPLIT = "split"  # forwards of max_batch computed rows, on two threads
    WHOLE = "whole"  # one forward of every row (at most twice max_batch computed rows)


TRIALS = 2  # steps timed in each layout before the faster one is kept


@dataclass
class _Timings:
    per_row_s: dict[Layout, list[float]] = field(
        default_factory=lambda: {layout: [] for layout in Layout})

    def next_trial(self) -> Layout | None:
        """The layout still to be timed, if any (alternating, so neither always runs on a
        warmer or a busier machine)."""
        split, whole = (len(self.per_row_s[layout]) for layout in Layout)
        if split >= TRIALS and whole >= TRIALS:
            return None
        return Layout.SPLIT if split <= whole else Layout.WHOLE

    def fastest(self) -> Layout:
        return min(Layout, key=lambda layout: sum(self.per_row_s[layout]))


class ForwardLayouts:
    """Per geometry: the layout to use, found by timing both on the first steps."""

    def __init__(self) -> None:
        self._timings: dict[Hashable, _Timings] = {}

    def choose(self, geometry: Hashable) -> Layout:
        timings = self._timings.setdefault(geometry, _Timings())
        return timings.next_trial() or timings.fastest()

    def observe(self, geometry: Hashable, layout: Layout, rows: int, seconds: float) -> None:
        """A step's forwards of ``geometry`` took ``seconds`` for ``rows`` rows laid out so
        (the engine leaves out steps that also proved or checked a batch: those ran the rows
        one at a time as well)."""
        timings = self._timings.setdefault(geometry, _Timings())
        if len(timings.per_row_s[layout]) < TRIALS:
            timings.per_row_s[layout].append(seconds / rows)
            if timings.next_trial() is None:
                log.info("forwards of %s laid out %s (ms per row: %s)", geometry,
                         timings.fastest().value,
                         {la.value: round(sum(t) / len(t) * 1000, 2)
                          for la, t in timings.per_row_s.items()})
