"""One training phase, run step by step with progress, timed checkpoints and resume.

A phase owns its modules, its optimizer and a loss for step k. The loop here is the only
place that decides when to checkpoint or stop, so every phase resumes the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from training import checkpoint
from training.checkpoint import Position


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    steps: int
    optimizer: torch.optim.Optimizer
    loss: Callable[[int], torch.Tensor]  # the loss of step k; backward is the loop's
    lr: Callable[[int], float] | None = None  # the learning rate of step k; None: constant


def warmup_cosine(peak: float, steps: int, warmup: int = 50,
                  floor: float = 0.1) -> Callable[[int], float]:
    """A linear warm-up to ``peak``, then a cosine decay to ``floor * peak``. A pure function
    of the step, so a resumed run needs no scheduler state."""
    def lr(step: int) -> float:
        rise = min(1.0, (step + 1) / warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
        return peak * rise * (floor + (1 - floor) * cosine)
    return lr


@dataclass(frozen=True, slots=True)
class Budget:
    """When to write a checkpoint and when to stop this run (the steps a run may take)."""

    checkpoint_every_s: float
    max_steps: int | None = None  # None: run to the end


@dataclass
class Run:
    """A run across phases: where it checkpoints, what it saves, the shared noise generator
    and how many steps this invocation has taken."""

    directory: Path
    modules: dict[str, torch.nn.Module]
    generator: torch.Generator
    budget: Budget
    show_progress: bool = True
    steps_taken: int = 0

    @property
    def out_of_steps(self) -> bool:
        return self.budget.max_steps is not None and self.steps_taken >= self.budget.max_steps

    def save(self, position: Position, optimizer: torch.optim.Optimizer) -> None:
        checkpoint.save(self.directory, position, self.modules, optimizer, self.generator)

    def step_through(self, phase: Phase, start: int, extra: dict[str, object]) -> bool:
        """Take ``phase`` from step ``start`` to its end or to the budget; True when it
        finished. A checkpoint is written every ``checkpoint_every_s`` and on stopping."""
        last_save = time.monotonic()
        columns = (TextColumn(f"[bold]{phase.name}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn())
        with Progress(*columns, disable=not self.show_progress) as progress:
            task = progress.add_task(phase.name, total=phase.steps, completed=start, loss=0.0)
            for step in range(start, phase.steps):
                if self.out_of_steps:
                    self.save(Position(phase.name, step, extra), phase.optimizer)
                    return False
                if phase.lr is not None:
                    for group in phase.optimizer.param_groups:
                        group["lr"] = phase.lr(step)
                phase.optimizer.zero_grad(set_to_none=True)
                loss = phase.loss(step)
                loss.backward()
                phase.optimizer.step()
                self.steps_taken += 1
                progress.update(task, advance=1, loss=loss.item())
                if time.monotonic() - last_save >= self.budget.checkpoint_every_s:
                    self.save(Position(phase.name, step + 1, extra), phase.optimizer)
                    last_save = time.monotonic()
        return True
