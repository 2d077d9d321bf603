"""The engine of one denoise worker, shaped like vLLM's ``EngineCore``: runs are added, a step
advances every run that may move by one denoising step, and runs leave between steps.

Each step is planned centrally: every run says which rows it needs (after its CFG cache
lookups, all asked in one round trip), rows of one geometry share forwards (the conditional
and unconditional rows of every run alike, at most ``max_tokens`` token-rows each, and
``max_batch`` rows on two threads or twice that in one forward, as ``layout`` measured faster;
texts of different lengths are padded where the family allows it, else they group by length),
and each run finishes its own step with its own scheduler.
Runs at different steps share a forward: the timestep is per row. Rows under step caches run
first, with their runs' hook states (``step_cache``), sharing a forward only where their skip
decisions are bound to be equal. Family code stays behind
``Denoiser.predict``; the engine knows tensors, not models.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_all
from dataclasses import dataclass, field

import torch

from keys import GenerationSpec
from workers.engine.exact_rows import checks_made, pad_texts, rows_apart
from workers.engine.layout import ForwardLayouts, Layout
from workers.engine.row_proof import RowProof
from workers.engine.run import DenoiseRun
from workers.engine.step_cache import StepCacheHooks, decision_key
from workers.engine.timing import release_memory, seconds_since
from workers.families.base import Denoiser
from workers.stages.guidance import ExactTier, Row, StepPlan
from workers.stages.interrupt import BlockInterrupts, StepInterrupted

log = logging.getLogger(__name__)

# The rows of one forward: which run, which of its rows.
Slot = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Computed:
    """What the forwards of a set of rows gave: each row's output and share of its forward's
    seconds, and the rows of each forward run."""

    outputs: dict[Slot, torch.Tensor] = field(default_factory=dict)
    seconds: dict[Slot, float] = field(default_factory=dict)
    forwards: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step did: the rows of each forward it ran, the runs it advanced, and the runs
    whose own part of it (guidance, scheduler) raised, which must leave."""

    forwards: list[int] = field(default_factory=list)
    advanced: list[DenoiseRun] = field(default_factory=list)
    failed: list[tuple[DenoiseRun, Exception]] = field(default_factory=list)


def _group_key(row: Row, pads_text: bool) -> tuple[object, ...]:
    """Rows may share a forward when this is equal: their geometry, and their text's length
    unless the family pads texts."""
    text = row.embeds.shape[2:] if pads_text else row.embeds.shape[1:]
    return (*_geometry(row), tuple(text))


def _geometry(row: Row) -> tuple[object, ...]:
    spec = row.spec
    condition = None if row.condition is None else tuple(row.condition.shape[1:])
    return (tuple(row.latents.shape[1:]), row.latents.dtype, spec.width, spec.height,
            spec.num_frames, condition)


def _tokens(model: Denoiser, row: Row) -> int:
    """The image tokens ``row`` puts through the transformer, its condition's included."""
    return model.tokens(row.spec, None if row.condition is None else tuple(row.condition.shape))


class DenoiseEngine:
    def __init__(self, model: Denoiser, max_batch: int, max_tokens: int,
                 parallel: bool, exact_tier: ExactTier | None) -> None:
        self.model = model
        # Asked for every run's unconditional row of a step at once, before the forwards
        # (None: an engine without the store, which asks nothing).
        self.exact_tier = exact_tier
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        # Whether batched rows are exact is proven here, on this device, per geometry and
        # batch size, before a batched result is used (README "The denoise engine").
        self.proof = RowProof()
        self.layouts = ForwardLayouts()
        self.runs: list[DenoiseRun] = []
        # Independent forwards of one step (a step's conditional and unconditional rows when
        # their texts differ in length) run on two threads, each with this thread's intra-op
        # count: a kernel splits work by its thread count, and results must not depend on it.
        # Not on a GPU: both threads would queue their kernels on its one stream.
        self._pool = (ThreadPoolExecutor(2, "forward", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))
                      if parallel and model.device.type != "cuda" else None)
        self._interrupts = BlockInterrupts(model.transformer)
        self.hooks = StepCacheHooks(model.transformer, model.step_cache_config)
        self._largest_forward = 0  # token-rows of the largest forward of the current step

    # --- membership ----------------------------------------------------------------------

    @property
    def room(self) -> int:
        return self.max_batch - len(self.runs)

    def add(self, run: DenoiseRun) -> None:
        self.runs.append(run)

    def abort(self, run: DenoiseRun) -> None:
        self.runs.remove(run)

    def leaving(self) -> list[DenoiseRun]:
        """The runs that finished (and hold the decode credit their handoff needs) or must
        stop, taken out of the engine."""
        out = [r for r in self.runs if (r.finished and r.has_credit) or r.wants_stop]
        self.runs = [r for r in self.runs if r not in out]
        return out

    # --- before the first job -------------------------------------------------------------

    def warm_up(self, spec: GenerationSpec, budget_s: float) -> list[int]:
        """Prove, on synthetic rows of ``spec``'s geometry, every batch size a forward of this
        engine may take there (``_per_forward``, at its loosest: the shortest text), smallest
        first so each proof leans on the one before, until ``budget_s`` has passed; the sizes
        proven. Which kernel a size gets, and so how its rows round, depends on the shapes,
        not on the values, so the proof holds for the requests that follow. (The per-layer
        checks of ``rows_apart`` are keyed by text lengths as well: those of lengths the
        warm-up did not use still run when they first come.)"""
        if self.max_batch == 1:
            return []
        start = time.perf_counter()
        tokens, width = self.model.text_shape()
        # The family's own latents, for their dtype and device (the rows' inputs take both).
        latents, generator = self.model.initial_latents(spec)
        condition = self.model.condition_shape(spec)
        largest = self._per_forward(self.model.tokens(spec, condition), 1)[1]

        def noise(*size: int) -> torch.Tensor:
            return torch.randn(size, generator=generator).to(latents)

        timesteps = self.model.scheduler(spec).timesteps
        # Texts of three lengths where the family pads them, so the padded paths are proven.
        rows = [Row(noise(*latents.shape), timesteps[i % len(timesteps)],
                    noise(1, max(1, tokens - (i % 3 if self.model.pads_text else 0)), width),
                    spec, condition=None if condition is None else noise(*condition))
                for i in range(largest)]
        geometry = _geometry(rows[0])
        self.hooks.off()
        for size in range(2, largest + 1):
            if seconds_since(start, self.model.device) > budget_s:
                break
            try:
                self._forward(rows[:size])
            except torch.OutOfMemoryError:
                self.fit_after_out_of_memory()
                break
        return [size for size in range(2, largest + 1) if self.proof.proven(geometry, size)]

    def fit_after_out_of_memory(self) -> None:
        """A forward of this step ran out of device memory: from now on a forward takes at
        most half its token-rows (one row at the least), so the next steps fit."""
        release_memory(self.model.device)
        fits = max(1, self._largest_forward // 2)
        if fits < self.max_tokens:
            log.warning("out of %s memory in a forward of %d token-rows: forwards take at most "
                        "%d from now on", self.model.device, self._largest_forward, fits)
            self.max_tokens = fits

    def describe(self, run: DenoiseRun) -> str:
        """Why ``run`` cannot run here: its rows alone do not fit in the device's memory."""
        spec = run.spec
        return (f"out of {self.model.device} memory for one forward of its rows alone "
                f"({spec.width}x{spec.height}, {spec.num_frames} frame(s), "
                f"{self.model.tokens(spec)} image tokens a row); a smaller size or a device "
                "with more memory serves it")

    def _per_forward(self, image_tokens: int, text_tokens: int) -> tuple[int, int]:
        """The most rows one forward of rows this long takes, within ``max_tokens``: as one of
        several forwards of ``max_batch`` rows, and as the one forward of a whole step."""
        by_tokens = max(1, self.max_tokens // max(image_tokens + text_tokens, 1))
        return min(self.max_batch, by_tokens), min(2 * self.max_batch, by_tokens)

    # --- a step --------------------------------------------------------------------------

    def step(self, only: Sequence[DenoiseRun] | None = None) -> StepResult:
        """Advance every run (of ``only``, if given) that holds its decode credit by one step.
        If planning or a forward raises, nothing of the step was applied to any run; a step
        that every one of its runs abandons (all asked to stop) changes none either."""
        active = [r for r in (self.runs if only is None else only)
                  if r.has_credit and not r.finished]
        result = StepResult()
        if not active:
            return result
        plans = [run.plan() for run in active]
        if self.exact_tier is not None:
            self.exact_tier.look_up([(run.guidance, plan)
                                     for run, plan in zip(active, plans, strict=True)])
        rows = {(i, j): row for i, plan in enumerate(plans) for j, row in enumerate(plan.rows)}
        try:
            with self._interrupts.watching(lambda: all(r.wants_stop for r in active)):
                computed = self.compute(rows)
        except StepInterrupted:
            for run in active:
                run.stopped_mid_step()
            return result
        result.forwards.extend(computed.forwards)
        done: list[StepPlan] = []
        for i, (run, plan) in enumerate(zip(active, plans, strict=True)):
            n = len(plan.rows)
            try:
                run.advance(plan, [computed.outputs[i, j] for j in range(n)],
                            [computed.seconds[i, j] for j in range(n)])
            except Exception as exc:  # its scheduler may be half-stepped: it must leave
                result.failed.append((run, exc))
                continue
            result.advanced.append(run)
            done.append(plan)
        if self.exact_tier is not None:
            self.exact_tier.store(done)
        return result

    def compute(self, rows: dict[Slot, Row]) -> Computed:
        """Every row's output, the rows shared out into forwards as the module says."""
        self._largest_forward = 0
        computed = Computed()
        for slots, out, took in self._run_forwards(rows):
            computed.forwards.append(len(slots))
            for n, slot in enumerate(slots):
                computed.outputs[slot] = out[n:n + 1]
                computed.seconds[slot] = took / len(slots)
        return computed

    def _run_forwards(self, rows: dict[Slot, Row]
                      ) -> Iterator[tuple[list[Slot], torch.Tensor, float]]:
        # Rows under a step cache first, one forward after another (the hooks hold one
        # forward's state at a time, and every forward while they are on goes through them).
        cached = {slot: row for slot, row in rows.items() if row.cached is not None}
        for chunk in self._hooked_chunks(cached):
            yield chunk, *self._hooked([cached[s] for s in chunk])
        rows = {slot: row for slot, row in rows.items() if row.cached is None}
        if not rows:
            return
        self.hooks.off()
        groups = list(self._groups(rows))
        chunks = [chunk for _, _, group in groups for chunk in group]
        calls = [lambda c=c: self._forward([rows[s] for s in c]) for c in chunks]
        checks = self.proof.verdicts + checks_made()
        start = time.perf_counter()
        if self._pool is None or len(calls) == 1:
            results = [call() for call in calls]
        else:
            futures = [self._pool.submit(call) for call in calls]
            wait_for_all(futures)  # none outlives the step, even when one raises
            results = [f.result() for f in futures]
        geometry, layout, _ = groups[0]
        # A step times its layout if it was one layout's alone and checked nothing (a check
        # computes the rows one at a time as well).
        if (len(groups) == 1 and not cached and layout is not None
                and self.proof.verdicts + checks_made() == checks):
            self.layouts.observe(geometry, layout, len(rows),
                                 seconds_since(start, self.model.device))
        for chunk, (out, took) in zip(chunks, results, strict=True):
            yield chunk, out, took

    def _groups(self, rows: dict[Slot, Row]
                ) -> Iterator[tuple[tuple[object, ...], Layout | None, list[list[Slot]]]]:
        """Rows that may share a forward, cut into forwards by the engine's bounds and the
        layout chosen for them (None: both layouts would cut them alike)."""
        groups: dict[tuple[object, ...], list[Slot]] = {}
        for slot, row in rows.items():
            groups.setdefault(_group_key(row, self.model.pads_text), []).append(slot)
        for slots in groups.values():
            # Texts of one length side by side: the layers that keep each text to its own
            # positions then take a length's rows as a view, not a gather, and the forwards
            # cut below hold fewer lengths each.
            slots.sort(key=lambda s: rows[s].embeds.shape[1])
            first = rows[slots[0]]
            text = max(rows[s].embeds.shape[1] for s in slots)
            split, whole = self._per_forward(_tokens(self.model, first), text)
            geometry = _geometry(first)
            layout = (self.layouts.choose(geometry)
                      if self.max_batch > 1 and len(slots) > split and whole > split else None)
            per_forward = self.proof.usable(geometry, whole if layout is Layout.WHOLE
                                            else split)
            yield geometry, layout, [slots[start:start + per_forward]
                                     for start in range(0, len(slots), per_forward)]

    def _hooked_chunks(self, rows: dict[Slot, Row]) -> Iterator[list[Slot]]:
        """Rows under step caches that may share a forward: those whose skip decisions are
        bound to be equal (``decision_key``), of one geometry and text length; a row whose
        decision its own data makes (first-block) has a forward of its own."""
        groups: dict[object, list[Slot]] = {}
        for slot, row in rows.items():
            assert row.cached is not None
            key = decision_key(row.cached)
            groups.setdefault(slot if key is None else (key, _group_key(row, False)),
                              []).append(slot)
        for slots in groups.values():
            first = rows[slots[0]]
            size = self._per_forward(_tokens(self.model, first), first.embeds.shape[1])[0]
            yield from (slots[start:start + size] for start in range(0, len(slots), size))

    def _hooked(self, rows: Sequence[Row]) -> tuple[torch.Tensor, float]:
        """Rows under one step-cache decision in one forward, their hook states joined, once
        that is proven equal to each row alone with its own state (as every batched forward
        is; under its own proof, the hooks skipping parts of it)."""
        start = time.perf_counter()
        self._note_size(rows)
        slots = [row.cached for row in rows if row.cached is not None]
        geometry = (*_geometry(rows[0]), slots[0].cache.policy)
        if len(rows) == 1 or not self.proof.trusted(geometry, len(rows)):
            return self._apart(rows), seconds_since(start, self.model.device)
        batched = self.hooks.forward_many(slots, lambda: self._batched(rows))
        # The first time, the rows alone run as well (each leaving its own state, which then
        # stands) and decide.
        out = self.proof.settle(geometry, batched, lambda: self._apart(rows))
        return out, seconds_since(start, self.model.device)

    def _forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        self._note_size(rows)
        geometry = _geometry(rows[0])
        if len(rows) == 1 or not self.proof.trusted(geometry, len(rows)):
            return self._apart(rows), seconds_since(start, self.model.device)
        out = self.proof.settle(geometry, self._batched(rows),
                                lambda: self._reference(geometry, rows))
        return out, seconds_since(start, self.model.device)

    def _note_size(self, rows: Sequence[Row]) -> None:
        tokens = _tokens(self.model, rows[0]) + max(r.embeds.shape[1] for r in rows)
        self._largest_forward = max(self._largest_forward, tokens * len(rows))

    def _batched(self, rows: Sequence[Row]) -> torch.Tensor:
        latents = torch.cat([r.latents for r in rows])
        timesteps = torch.stack([r.timestep for r in rows])
        embeds, mask = pad_texts([r.embeds for r in rows], _tokens(self.model, rows[0]))
        conditions = [r.condition for r in rows if r.condition is not None]
        if conditions and len(conditions) != len(rows):  # ``_geometry`` keeps them apart
            raise ValueError("rows with and without an image condition in one forward")
        condition = torch.cat(conditions) if conditions else None
        with rows_apart(mask):
            return self.model.predict(latents, timesteps, embeds, rows[0].spec, mask,
                                      condition)

    def _reference(self, geometry: tuple[object, ...], rows: Sequence[Row]) -> torch.Tensor:
        """The rows as forwards already proven compute them, to prove a new batch size
        against: in batches of the largest size proven for ``geometry`` (each proven equal to
        its rows alone), the rest each alone. Proving 16 rows then costs two forwards of 8,
        not 16 forwards of one."""
        size = self.proof.largest_proven(geometry, below=len(rows))
        if size < 2:
            return self._apart(rows)
        parts = []
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            parts.append(self._batched(chunk) if self.proof.proven(geometry, len(chunk))
                         else self._apart(chunk))
        return torch.cat(parts)

    def _apart(self, rows: Sequence[Row]) -> torch.Tensor:
        """Each row in a forward of its own, as the request alone computes it."""
        return torch.cat([self._alone(r) for r in rows])

    def _alone(self, row: Row) -> torch.Tensor:
        def predict() -> torch.Tensor:
            return self.model.predict(row.latents, row.timestep.reshape(1), row.embeds, row.spec,
                                      condition=row.condition)

        return predict() if row.cached is None else self.hooks.forward(row.cached, predict)

