"""What each row of the forward at hand runs under: its step cache and its adapters. A row's
choices are its own; the batch is only how the arithmetic is shared. The module wrappers that
apply them (``row_caches``, ``row_adapters``) read the forward of their thread here, and see
which rows a call holds when a block or module runs on some of the batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from workers.engine.exact_rows import rows_apart

Cache = TypeVar("Cache")  # a row's step cache in a forward (``row_caches.RowCache``)

# The adapters a row's forward applies, in order: (peft adapter name, scale).
RowAdapters = tuple[tuple[str, float], ...]

_local = threading.local()


@dataclass
class Forward(Generic[Cache]):
    """One forward's rows: each one's step cache (None: none) and adapters (``()``: the base
    model), and the rows of the batch the call at hand holds."""

    caches: Sequence[Cache | None]
    adapters: Sequence[RowAdapters]
    text: rows_apart | None = None

    def __post_init__(self) -> None:
        self.current = list(range(len(self.caches)))
        # Rows a step cache passes through the blocks that remain (they skip them).
        self.passing: set[int] = set()

    @contextmanager
    def holding(self, rows: list[int]) -> Iterator[None]:
        """Calls within hold only ``rows`` (the forward's) of the batch."""
        before = self.current
        self.current = rows
        try:
            if self.text is None:
                yield
            else:
                with self.text.narrowed(rows):
                    yield
        finally:
            self.current = before


@contextmanager
def running(forward: Forward[Any]) -> Iterator[Forward[Any]]:
    """``forward`` is this thread's for the block."""
    before = getattr(_local, "forward", None)
    _local.forward = forward
    try:
        yield forward
    finally:
        _local.forward = before


def active() -> Forward[Any] | None:
    """The forward this thread runs, if it runs one with per-row choices."""
    forward: Forward[Any] | None = getattr(_local, "forward", None)
    return forward
