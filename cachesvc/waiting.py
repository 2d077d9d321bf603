"""One way to wait for something to happen: poll a predicate until it holds or a deadline passes.

Tests, benchmarks and the command line wait through ``wait_until``, so no wait can hang forever
and every one that gives up says what it waited for and for how long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, overload

T = TypeVar("T")


# Not "...Error": api.service.WaitTimeoutError is the API's 504, a different thing.
class WaitTimeout(TimeoutError):  # noqa: N818
    """What was awaited did not happen within the timeout; the message names both."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what}: not within {timeout_s:g} s")
        self.what = what
        self.timeout_s = timeout_s


@overload
def wait_until(predicate: Callable[[], bool], *, timeout_s: float, what: str,
               interval_s: float = 0.01) -> bool: ...


@overload
def wait_until(predicate: Callable[[], T | None], *, timeout_s: float, what: str,
               interval_s: float = 0.01) -> T: ...


def wait_until(predicate: Callable[[], T | bool | None], *, timeout_s: float, what: str,
               interval_s: float = 0.01) -> T | bool:
    """Call ``predicate`` every ``interval_s`` until it returns something truthy, and return
    that; raise WaitTimeout naming ``what`` once ``timeout_s`` has passed without it.

    The predicate runs at least once, and once more at the deadline, so a condition that holds
    when the time runs out still counts. A falsy value (None, False, 0, an empty container)
    means "not yet"."""
    if timeout_s < 0 or interval_s <= 0:
        raise ValueError(f"wait_until needs timeout_s >= 0 and interval_s > 0, "
                         f"not {timeout_s} and {interval_s}")
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(what, timeout_s)
        time.sleep(min(interval_s, remaining))
