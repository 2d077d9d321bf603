"""The engine of one denoise worker, in the shape of vLLM v1's ``EngineCore``: runs are added,
a step advances every run that may move by one denoising step, and runs leave between steps.

A step has three parts. Each run plans its rows (its conditional and unconditional rows, each
under the run's step cache and adapters); the worker loop may answer some of them from the
exact CFG tier in between (``plan``, then ``run``: the I/O is the loop's). The scheduler
shares the rows out into forwards from their states alone (``scheduler``), and the executor
runs them (``executor``). Each run then finishes its own step with its own scheduler. Rows of
every run share forwards whatever their step, step-cache policy or adapter set: a row's
timestep, cache decisions and low-rank updates are its own. Family code stays behind
``Denoiser.predict``; the engine knows tensors, not models.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from keys import GenerationSpec
from workers.engine.executor import Computed, Executor, geometry, tokens
from workers.engine.forward_inputs import Ranks
from workers.engine.guidance import Row, StepPlan
from workers.engine.interrupt import StepInterrupted
from workers.engine.run import DenoiseRun
from workers.engine.scheduler import Limits, RowNeed, Scheduler, Slot
from workers.engine.timing import release_memory
from workers.families.base import Denoiser

log = logging.getLogger(__name__)

# A step's runs, each with the rows it planned.
Planned = list[tuple[DenoiseRun, StepPlan]]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step did: the rows of each forward it ran, the runs it advanced (with their
    plans, whose computed unconditional rows the exact tier keeps), and the runs whose own
    part of it (guidance, scheduler) raised, which must leave."""

    forwards: list[int] = field(default_factory=list)
    advanced: list[DenoiseRun] = field(default_factory=list)
    done: list[StepPlan] = field(default_factory=list)
    failed: list[tuple[DenoiseRun, Exception]] = field(default_factory=list)


class DenoiseEngine:
    def __init__(self, model: Denoiser, max_batch: int, max_tokens: int, adapters: int,
                 parallel: bool, ride_along: int = 2, ranks: Ranks | None = None) -> None:
        self.model = model
        self.scheduler = Scheduler(Limits(max_batch, max_tokens, adapters, ride_along))
        self.executor = Executor(model, parallel, ranks)
        self.runs: list[DenoiseRun] = []

    @property
    def max_batch(self) -> int:
        return self.scheduler.limits.max_batch

    @property
    def max_tokens(self) -> int:
        return self.scheduler.limits.max_tokens

    # --- membership ----------------------------------------------------------------------

    @property
    def room(self) -> int:
        return self.scheduler.room([run.view for run in self.runs])

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
        """Prove every batch size a forward of this engine may take at ``spec``'s geometry
        (at its loosest: the shortest text); the sizes proven. A warm-up out of device memory
        stops there and lowers the engine's bound (``fit_after_out_of_memory``)."""
        if self.max_batch == 1:
            return []
        condition = self.model.condition_shape(spec)
        largest = self.scheduler.most_rows(self.model.tokens(spec, condition), 1)
        proven, out_of_memory = self.executor.warm_up(spec, largest, budget_s)
        if out_of_memory:
            self.fit_after_out_of_memory()
        return proven

    def fit_after_out_of_memory(self) -> None:
        """A forward ran out of device memory: from now on a forward takes at most half its
        token-rows (one row at the least), so the next steps fit."""
        release_memory(self.model.device)
        largest = self.executor.largest_forward
        fits = max(1, largest // 2)
        if fits < self.max_tokens:
            log.warning("out of %s memory in a forward of %d token-rows: forwards take at most "
                        "%d from now on", self.model.device, largest, fits)
            self.scheduler.limits = dataclasses.replace(self.scheduler.limits, max_tokens=fits)

    def describe(self, run: DenoiseRun) -> str:
        """Why ``run`` cannot run here: its rows alone do not fit in the device's memory."""
        spec = run.spec
        return (f"out of {self.model.device} memory for one forward of its rows alone "
                f"({spec.width}x{spec.height}, {spec.num_frames} frame(s), "
                f"{self.model.tokens(spec)} image tokens a row); a smaller size or a device "
                "with more memory serves it")

    # --- a step --------------------------------------------------------------------------

    def plan(self, only: Sequence[DenoiseRun] | None = None) -> Planned:
        """The step of every run (of ``only``, if given) that holds its decode credit: each
        with the rows it needs. Nothing of a run changes until ``run``."""
        active = [r for r in (self.runs if only is None else only)
                  if r.has_credit and not r.finished]
        return [(run, run.plan()) for run in active]

    def run(self, planned: Planned) -> StepResult:
        """The planned step: its forwards, then each run's own part. If a forward raises,
        nothing of the step was applied to any run; a step that every one of its runs
        abandons (all asked to stop) changes none either."""
        result = StepResult()
        if not planned:
            return result
        rows = {(i, j): row for i, (_, plan) in enumerate(planned)
                for j, row in enumerate(plan.rows)}
        weights = [run.weight for run, _ in planned]
        try:
            with self.executor.watching(lambda: all(r.wants_stop for r, _ in planned)):
                computed = self.compute(rows, weights)
        except StepInterrupted:
            for run, _ in planned:
                run.stopped_mid_step()
            return result
        result.forwards.extend(computed.forwards)
        for i, (run, plan) in enumerate(planned):
            n = len(plan.rows)
            try:
                run.advance(plan, [computed.outputs[i, j] for j in range(n)],
                            [computed.seconds[i, j] for j in range(n)])
            except Exception as exc:  # its scheduler may be half-stepped: it must leave
                result.failed.append((run, exc))
                continue
            result.advanced.append(run)
            result.done.append(plan)
        return result

    def step(self, only: Sequence[DenoiseRun] | None = None) -> StepResult:
        """``plan`` and ``run`` with no exact tier between them."""
        return self.run(self.plan(only))

    def compute(self, rows: dict[Slot, Row], weights: Sequence[float] | None = None
                ) -> Computed:
        """Every row's output: the scheduler shares the rows out into forwards, the executor
        runs them. ``weights``: the share of its rows each run is expected to compute (its
        ``weight``; all of them if not given)."""
        needs = [RowNeed(slot, self._group(row), geometry(row), tokens(self.model, row),
                         row.embeds.shape[1], frozenset(name for name, _ in row.adapters),
                         1.0 if weights is None else weights[slot[0]])
                 for slot, row in rows.items()]
        planned = self.scheduler.forwards(needs, self.executor.layout,
                                          self.executor.proof.usable)
        return self.executor.run(planned, rows)

    def _group(self, row: Row) -> tuple[object, ...]:
        """Rows may share a forward when this is equal: their geometry, and their text's
        length unless the family pads texts."""
        text = row.embeds.shape[2:] if self.model.pads_text else row.embeds.shape[1:]
        return (*geometry(row), tuple(text))
