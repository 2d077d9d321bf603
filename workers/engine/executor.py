"""The engine's executor: it runs the forwards the scheduler planned, on this worker's device.

A forward's rows are concatenated (texts padded where the family pads them) and run through the
family's ``Denoiser.predict`` inside ``rows_apart``, with each row's step cache and adapters its
own (``forward_rows``). The first forward of each geometry and batch size is proven equal to
its rows alone (``row_proof``) before its result is used; independent forwards of one step may
run on two threads; how a step's rows are cut is timed per geometry (``layout``). In a denoise
group every forward runs on all its ranks (``ranks``). The executor
decides nothing about who shares a forward: the scheduler did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_all
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from keys import GenerationSpec
from workers.engine.exact_rows import checks_made, pad_texts
from workers.engine.forward_inputs import ForwardInputs, Ranks, predict
from workers.engine.guidance import Row
from workers.engine.interrupt import BlockInterrupts
from workers.engine.layout import ForwardLayouts, Layout
from workers.engine.row_adapters import AdapterRows
from workers.engine.row_caches import RowCache, RowCaches
from workers.engine.row_proof import RowProof
from workers.engine.scheduler import PlannedForward, Slot
from workers.engine.timing import seconds_since
from workers.families.base import Denoiser


@dataclass(frozen=True, slots=True)
class Computed:
    """What the forwards of a set of rows gave: each row's output and share of its forward's
    seconds, and the rows of each forward run."""

    outputs: dict[Slot, torch.Tensor] = field(default_factory=dict)
    seconds: dict[Slot, float] = field(default_factory=dict)
    forwards: list[int] = field(default_factory=list)


def geometry(row: Row) -> tuple[object, ...]:
    """What the row proof and the layouts are kept by: the latents' shape and dtype, the
    request's size, and the image condition's shape."""
    spec = row.spec
    condition = None if row.condition is None else tuple(row.condition.shape[1:])
    return (tuple(row.latents.shape[1:]), row.latents.dtype, spec.width, spec.height,
            spec.num_frames, condition)


def tokens(model: Denoiser, row: Row) -> int:
    """The image tokens ``row`` puts through the transformer, its condition's included."""
    return model.tokens(row.spec, None if row.condition is None else tuple(row.condition.shape))


class Executor:
    """Runs forwards of rows on one denoiser."""

    def __init__(self, model: Denoiser, parallel: bool, ranks: Ranks | None = None) -> None:
        self.model = model
        self.ranks = ranks
        # Whether batched rows are exact is proven here, on this device, per geometry and
        # batch size, before a batched result is used.
        self.proof = RowProof()
        self.layouts = ForwardLayouts()
        # Independent forwards of one step run on two threads, each with this thread's
        # intra-op count: a kernel splits work by its thread count, and results must not
        # depend on it. Not on a GPU: both threads would queue their kernels on its one stream.
        # Nor in a group: its ranks must meet in every collective in the same order.
        self._pool = (ThreadPoolExecutor(2, "forward", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
                      if parallel and model.device.type != "cuda" and ranks is None
                      else None)
        self.interrupts = BlockInterrupts(model.transformer)
        self.caches = RowCaches(model.transformer, model.step_cache_config)
        self.adapters = AdapterRows(model.transformer)
        self.largest_forward = 0  # token-rows of the largest forward of the last ``run``

    def run(self, planned: Sequence[PlannedForward], rows: dict[Slot, Row]) -> Computed:
        """Every planned forward's rows, each row's output and its share of the seconds."""
        self.largest_forward = 0
        computed = Computed()
        for slots, out, took in self._forwards(planned, rows):
            computed.forwards.append(len(slots))
            for n, slot in enumerate(slots):
                computed.outputs[slot] = out[n:n + 1]
                computed.seconds[slot] = took / len(slots)
        return computed

    @contextmanager
    def watching(self, should_stop: Callable[[], bool]) -> Iterator[None]:
        """Forwards run within the block stop between blocks once ``should_stop()``. Not
        in a group: its other ranks would wait for this one inside the forward, or send it
        rows it no longer takes, so a group's forwards stop at their end."""
        if self.ranks is not None:
            yield
            return
        with self.interrupts.watching(should_stop):
            yield

    def _forwards(self, planned: Sequence[PlannedForward], rows: dict[Slot, Row]
                  ) -> Iterator[tuple[tuple[Slot, ...], torch.Tensor, float]]:
        calls = [lambda f=f: self.forward([rows[s] for s in f.slots]) for f in planned]
        checks = self.proof.verdicts + checks_made()
        start = time.perf_counter()
        if self._pool is None or len(calls) <= 1:
            results = [call() for call in calls]
        else:
            futures = [self._pool.submit(call) for call in calls]
            wait_for_all(futures)  # none outlives the step, even when one raises
            results = [f.result() for f in futures]
        geometries = {f.geometry for f in planned}
        chosen = planned[0].layout if planned else None
        # A step times its layout if it was one geometry's alone and checked nothing (a check
        # computes the rows one at a time as well).
        if (len(geometries) == 1 and chosen is not None
                and self.proof.verdicts + checks_made() == checks):
            self.layouts.observe(planned[0].geometry, chosen, len(rows),
                                 seconds_since(start, self.model.device))
        for f, (out, took) in zip(planned, results, strict=True):
            yield f.slots, out, took

    def layout(self, key: Hashable) -> Layout:
        return self.layouts.choose(key)

    def forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, float]:
        """``rows`` in one forward where that is proven exact, else each alone; the seconds."""
        start = time.perf_counter()
        key = geometry(rows[0])
        size = len(rows)
        longest = max(r.embeds.shape[1] for r in rows)
        self.largest_forward = max(self.largest_forward,
                                   (tokens(self.model, rows[0]) + longest) * size)
        if size == 1 or not self.proof.trusted(key, size):
            return self._apart(rows), seconds_since(start, self.model.device)
        out, caches = self._batched(rows)
        separate: list[list[RowCache | None]] = []

        def alone() -> torch.Tensor:
            result, kept = self._reference(key, rows)
            separate.append(kept)
            return result

        used = self.proof.settle(key, out, alone)
        # The states of the rows' caches are those of the forward whose output is used.
        self._settle(rows, separate[0] if separate and used is not out else caches)
        return used, seconds_since(start, self.model.device)

    def _batched(self, rows: Sequence[Row]) -> tuple[torch.Tensor, list[RowCache | None]]:
        latents = torch.cat([r.latents for r in rows])
        timesteps = torch.stack([r.timestep for r in rows])
        embeds, mask = pad_texts([r.embeds for r in rows], tokens(self.model, rows[0]))
        conditions = [r.condition for r in rows if r.condition is not None]
        if conditions and len(conditions) != len(rows):  # ``geometry`` keeps them apart
            raise ValueError("rows with and without an image condition in one forward")
        condition = torch.cat(conditions) if conditions else None
        caches = [None if r.cached is None else self.caches.row(r.cached) for r in rows]
        inputs = ForwardInputs(latents, timesteps, embeds, rows[0].spec, mask, condition)
        adapters = [r.adapters for r in rows]

        def local(part: ForwardInputs, which: slice) -> torch.Tensor:
            return predict(self.model, part, caches[which], adapters[which])

        out = (local(inputs, slice(None)) if self.ranks is None
               else self.ranks.run(inputs, local))
        return out, caches

    def _reference(self, key: tuple[object, ...], rows: Sequence[Row]
                   ) -> tuple[torch.Tensor, list[RowCache | None]]:
        """The rows as forwards already proven compute them, to prove a new batch size
        against: in batches of the largest size proven for ``key`` (each proven equal to its
        rows alone), the rest each alone. Proving 16 rows then costs two forwards of 8, not
        16 forwards of one."""
        size = self.proof.largest_proven(key, below=len(rows))
        parts, caches = [], []
        for start in range(0, len(rows), max(size, 1)):
            chunk = rows[start:start + max(size, 1)]
            if size >= 2 and self.proof.proven(key, len(chunk)):
                out, kept = self._batched(chunk)
            else:
                out, kept = self._each(chunk)
            parts.append(out)
            caches += kept
        return torch.cat(parts), caches

    def _apart(self, rows: Sequence[Row]) -> torch.Tensor:
        """Each row in a forward of its own, as the request alone computes it."""
        out, caches = self._each(rows)
        self._settle(rows, caches)
        return out

    def _each(self, rows: Sequence[Row]) -> tuple[torch.Tensor, list[RowCache | None]]:
        outs, caches = [], []
        for row in rows:
            out, kept = self._batched([row])
            outs.append(out)
            caches += kept
        return torch.cat(outs), caches

    def _settle(self, rows: Sequence[Row], caches: Sequence[RowCache | None]) -> None:
        for row, cache in zip(rows, caches, strict=True):
            if row.cached is not None and cache is not None:
                self.caches.settle(row.cached, cache)

    def warm_up(self, spec: GenerationSpec, largest: int, budget_s: float
                ) -> tuple[list[int], bool]:
        """Prove, on synthetic rows of ``spec``'s geometry, every batch size from 2 to
        ``largest``, smallest first so each proof leans on the one before, until
        ``budget_s`` has passed; the sizes proven. Which kernel a size gets, and so how its
        rows round, depends on the shapes, not on the values, so the proof holds for the
        requests that follow. (The per-layer checks of ``rows_apart`` are keyed by text
        lengths as well: those of lengths the warm-up did not use still run when they first
        come.) Also whether it ran out of device memory, which ends it."""
        start = time.perf_counter()
        text_tokens, width = self.model.text_shape()
        # The family's own latents, for their dtype and device (the rows' inputs take both).
        latents, generator = self.model.initial_latents(spec)
        condition = self.model.condition_shape(spec)

        def noise(*size: int) -> torch.Tensor:
            return torch.randn(size, generator=generator).to(latents)

        timesteps = self.model.scheduler(spec).timesteps
        # Texts of three lengths where the family pads them, so the padded paths are proven.
        rows = [Row(noise(*latents.shape), timesteps[i % len(timesteps)],
                    noise(1, max(1, text_tokens - (i % 3 if self.model.pads_text else 0)),
                          width),
                    spec, condition=None if condition is None else noise(*condition))
                for i in range(largest)]
        key = geometry(rows[0])
        out_of_memory = False
        for size in range(2, largest + 1):
            if seconds_since(start, self.model.device) > budget_s:
                break
            try:
                self.forward(rows[:size])
            except torch.OutOfMemoryError:
                out_of_memory = True
                break
        return ([size for size in range(2, largest + 1) if self.proof.proven(key, size)],
                out_of_memory)
