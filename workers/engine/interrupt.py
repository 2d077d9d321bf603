"""Stopping inside a denoising step: cancel and preemption act between transformer blocks.

A step of a large request can take minutes, and cancel or preempt seen only at step boundaries
would wait for it. A hook before every block of the transformer raises ``StepInterrupted``
once the job should stop; the step is abandoned whole (the latents and the scheduler are only
updated after a step's forwards finish), so the request resumes from its last whole step,
bit-exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


class StepInterrupted(Exception):  # noqa: N818 - a signal to stop, not an error
    """Raised inside a forward when the job in hand should stop."""


class BlockInterrupts:
    """Hooks on every block of a transformer that raise while ``should_stop`` says so."""

    def __init__(self, transformer: nn.Module) -> None:
        self._check: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self.blocks = [block for child in transformer.children()
                       if isinstance(child, nn.ModuleList) for block in child]
        for block in self.blocks:
            block.register_forward_pre_hook(self._before_block)

    def _before_block(self, _module: nn.Module, _args: object) -> None:
        check = self._check
        if check is not None and check():
            raise StepInterrupted

    @contextmanager
    def watching(self, should_stop: Callable[[], bool]) -> Iterator[None]:
        """Interrupt forwards run within the block whenever ``should_stop()``."""
        with self._lock:
            self._check = should_stop
        try:
            yield
        finally:
            with self._lock:
                self._check = None
