"""The engine's scheduler: pure policy, in the shape of vLLM v1's ``Scheduler``. From the runs'
and rows' states alone it decides which waiting runs join, which run makes way for waiting
interactive work, and which rows share which forward; it touches no Redis, store or model,
so it is tested with none (``tests/test_scheduler.py``).

A row's step cache and adapters are its own (``forward_rows``): rows of every policy, step
and adapter set share a forward. What keeps rows apart is only what the arithmetic needs:
their geometry, their text's length where the family cannot pad texts, the token budget of a
forward, the batch sizes the row proof refused, and how many adapters one forward may carry.

``max_batch`` bounds the rows that compute. A row whose step cache passes its blocks by (a
first-block or MagCache skip) costs a fraction of one, so the engine holds, and a forward
carries, up to ``ride_along`` times as many rows as it computes: a step cache then shortens
a batched step as it shortens a lone one, instead of leaving the forward part empty. A run's
weight is the share of its rows its last step computed (1 before its first: every policy
computes its first steps).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from workers.engine.layout import Layout

# The rows of one forward: which run (its index in the step), which of its rows.
Slot = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int  # runs' weight an engine holds; rows a forward computes (twice, WHOLE)
    max_tokens: int  # token-rows one forward takes (image and text tokens, over its rows)
    adapters: int  # distinct adapters one forward, and one engine, may carry
    # How many times ``max_batch`` an engine holds runs, and a forward rows, when step caches
    # stand in for some (1: never more): bounded, so activation memory and a step's latency
    # stay near a full batch's where every row computes again.
    ride_along: int = 2


@dataclass(frozen=True, slots=True)
class RowNeed:
    """What one row of a step asks of a forward."""

    slot: Slot
    group: Hashable  # rows may share a forward only where this is equal
    geometry: Hashable  # what the row proof and the layouts are kept by
    image_tokens: int
    text_tokens: int
    adapters: frozenset[str]  # the adapters its forward must carry
    weight: float = 1.0  # the share of a computed row it is expected to cost (its run's)


@dataclass(frozen=True, slots=True)
class PlannedForward:
    geometry: Hashable
    layout: Layout | None  # None: either layout cuts these rows alike
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class RunView:
    """What the scheduler reads of a run held or waiting."""

    adapters: frozenset[str]
    preemptible: bool = False
    weight: float = 1.0  # the share of its rows its last step computed


class Scheduler:
    """Decides; the executor runs what it decides and the worker loop does the I/O."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def room(self, held: Sequence[RunView]) -> int:
        """How many more runs may join ``held``: joiners weigh one each, within ``max_batch``
        of weight and ``ride_along`` times as many runs."""
        weight = sum(run.weight for run in held)
        by_weight = math.floor(self.limits.max_batch - weight + 1e-9)
        return max(0, min(by_weight, self.limits.ride_along * self.limits.max_batch - len(held)))

    def admit(self, held: Sequence[RunView], waiting: Sequence[RunView]) -> list[int]:
        """The waiting runs (their positions, oldest first) that join now: while there is
        ``room``, and the engine's adapters with theirs stay within ``limits.adapters`` (a
        run that would overflow them waits; later ones may still join)."""
        adapters = set().union(*(run.adapters for run in held))
        room = self.room(held)
        joining = []
        for n, run in enumerate(waiting):
            if room <= 0:
                break
            if len(adapters | run.adapters) > self.limits.adapters:
                continue
            adapters |= run.adapters
            joining.append(n)
            room -= 1
        return joining

    def make_way(self, held: Sequence[RunView]) -> int | None:
        """The run (its position) that leaves a full engine for waiting interactive work:
        the preemptible one that joined last, which has the least to lose, of those whose
        leaving makes room (a run its step cache skipped weighs nothing: room by weight
        would not grow)."""
        candidates = [n for n, run in enumerate(held) if run.preemptible
                      and self.room([r for m, r in enumerate(held) if m != n]) >= 1]
        return candidates[-1] if candidates else None

    def forwards(self, rows: Sequence[RowNeed], layout: Callable[[Hashable], Layout],
                 usable: Callable[[Hashable, int], int]) -> list[PlannedForward]:
        """The forwards of a step's rows: those that may share one, shortest texts first,
        cut by the bounds (``layout`` of a geometry whose rows two layouts would cut apart;
        ``usable``: the largest batch size up to a bound the proof has not refused)."""
        groups: dict[Hashable, list[RowNeed]] = {}
        for row in rows:
            groups.setdefault(row.group, []).append(row)
        planned = []
        for members in groups.values():
            # Texts of one length side by side: the layers that keep each text to its own
            # positions then take a length's rows as a view, not a gather, and the cut
            # forwards hold fewer lengths each.
            members.sort(key=lambda r: r.text_tokens)
            first = members[0]
            longest = max(r.text_tokens for r in members)
            split, whole = self.per_forward(first.image_tokens, longest)
            rows_bound = self.most_rows(first.image_tokens, longest)
            weight = sum(r.weight for r in members)
            # Two layouts cut alike unless the rows exceed a SPLIT forward's weight or rows.
            apart = weight > split or len(members) > min(self.limits.ride_along * split,
                                                         rows_bound)
            chosen = (layout(first.geometry)
                      if self.limits.max_batch > 1 and apart and whole > split else None)
            size = whole if chosen is Layout.WHOLE else split
            fit = functools.partial(usable, first.geometry)
            most = fit(min(self.limits.ride_along * size, rows_bound))
            planned += [PlannedForward(first.geometry, chosen, tuple(r.slot for r in cut))
                        for cut in self._cut(members, fit(size), most, fit)]
        return planned

    def per_forward(self, image_tokens: int, text_tokens: int) -> tuple[int, int]:
        """The most computed rows one forward of rows this long takes: as one of several
        forwards of ``max_batch`` rows, and as the one forward of a whole step."""
        by_tokens = self.most_rows(image_tokens, text_tokens)
        return min(self.limits.max_batch, by_tokens), min(2 * self.limits.max_batch, by_tokens)

    def most_rows(self, image_tokens: int, text_tokens: int) -> int:
        """The most rows of this length one forward may take, computed or stood in for:
        within ``max_tokens``, and ``ride_along`` times the whole step's bound."""
        by_tokens = max(1, self.limits.max_tokens // max(image_tokens + text_tokens, 1))
        return min(self.limits.ride_along * 2 * self.limits.max_batch, by_tokens)

    def _cut(self, rows: list[RowNeed], weight: float, most: int,
             fit: Callable[[int], int]) -> list[list[RowNeed]]:
        """``rows`` in order, in forwards of at most ``weight`` computed rows, ``most`` rows
        and ``limits.adapters`` distinct adapters, each of a size the proof has not refused
        (``fit``: the largest such size up to a count)."""
        cuts: list[list[RowNeed]] = [[]]
        adapters: set[str] = set()
        carried = 0.0
        for row in rows:
            if (len(cuts[-1]) >= most or carried + row.weight > weight + 1e-9
                    or len(adapters | row.adapters) > self.limits.adapters) and cuts[-1]:
                cuts.append([])
                adapters = set()
                carried = 0.0
            cuts[-1].append(row)
            adapters |= row.adapters
            carried += row.weight
        fitted = []
        for cut in cuts:
            start = 0
            while start < len(cut):
                n = fit(len(cut) - start)
                fitted.append(cut[start:start + n])
                start += n
        return fitted
