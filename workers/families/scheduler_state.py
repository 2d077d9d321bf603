"""What a diffusers scheduler keeps between steps, captured and put back: the part of a
checkpoint that lets a trajectory continue bit-identically.

diffusers keeps this state in attributes, some private (``_step_index``), so each family names
its own scheduler's fields and ``tests/test_scheduler_state.py`` checks them against the pinned
diffusers: an upgrade that keeps more state fails that test instead of breaking resume silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class SchedulerStateError(ValueError):
    """A checkpoint's scheduler state does not fit the scheduler it is put back into."""


@dataclass(frozen=True, slots=True)
class SchedulerFields:
    """The attributes a scheduler changes as it steps, by kind. An attribute a scheduler has not
    set yet (UniPC's ``this_order`` before its first step) is left out of the state."""

    histories: tuple[str, ...] = ()  # lists of tensors or None: the last model outputs
    samples: tuple[str, ...] = ()  # a tensor or None
    counters: tuple[str, ...] = ()  # ints or None

    @property
    def names(self) -> tuple[str, ...]:
        return self.histories + self.samples + self.counters

    def capture(self, scheduler: Any) -> dict[str, Any]:
        """A copy of the state that later steps cannot change."""
        state: dict[str, Any] = {}
        for name in self.histories:
            if hasattr(scheduler, name):
                state[name] = [None if t is None else t.detach().clone()
                               for t in getattr(scheduler, name)]
        for name in self.samples:
            if hasattr(scheduler, name):
                value = getattr(scheduler, name)
                state[name] = None if value is None else value.detach().clone()
        for name in self.counters:
            if hasattr(scheduler, name):
                state[name] = getattr(scheduler, name)
        return state

    def restore(self, scheduler: Any, state: dict[str, Any], device: torch.device) -> None:
        """Put ``state`` back into a fresh scheduler, its tensors on ``device`` (where the
        scheduler's timesteps are)."""
        for name, value in state.items():
            if name not in self.names:
                raise SchedulerStateError(f"the checkpoint holds {name}, which "
                                          f"{type(scheduler).__name__} does not keep")
            setattr(scheduler, name, _on(value, device))


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [None if t is None else t.to(device) for t in value]
    return value.to(device) if isinstance(value, torch.Tensor) else value
