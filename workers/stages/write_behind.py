"""Store writes that run behind the denoising loop, on one thread, in submission order.

A failed write is logged with what it was, not raised: a lost checkpoint or CFG entry costs
recompute later, never a wrong result, and must not fail the job that produced it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, "write-behind")
        self._pending: list[tuple[str, Future[None]]] = []

    def submit(self, what: str, write: Callable[[], None]) -> None:
        self._pending.append((what, self._pool.submit(write)))

    def drain(self) -> int:
        """Wait for every write submitted so far; the number that failed."""
        failed = 0
        pending, self._pending = self._pending, []
        for what, future in pending:
            exc = future.exception()
            if exc is not None:
                failed += 1
                log.warning("write-behind of %s failed: %s", what, exc, exc_info=exc)
        return failed
