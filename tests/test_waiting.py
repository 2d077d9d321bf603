"""``wait_until``, the one poll of the tests, benchmarks and command line: it returns what the
predicate found, and gives up at its deadline with an error that says what it waited for."""

from __future__ import annotations

import itertools
import time

import pytest

from cachesvc.waiting import WaitTimeout, wait_until


def test_returns_the_first_truthy_value_of_the_predicate() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and {"n": n}, timeout_s=5,
                      what="a third call", interval_s=0.001) == {"n": 3}


def test_a_timeout_names_what_was_awaited_and_for_how_long() -> None:
    start = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        wait_until(lambda: None, timeout_s=0.05, what="the moon turning blue", interval_s=0.01)
    assert time.monotonic() - start >= 0.05
    assert str(info.value) == "the moon turning blue: not within 0.05 s"
    assert isinstance(info.value, TimeoutError)
    assert (info.value.what, info.value.timeout_s) == ("the moon turning blue", 0.05)


def test_the_predicate_runs_at_least_once_and_again_at_the_deadline() -> None:
    assert wait_until(lambda: "at once", timeout_s=0, what="no wait") == "at once"
    seen = []

    def late() -> bool:
        seen.append(time.monotonic())
        return len(seen) > 1

    # A long interval: the second call is the one at the deadline, and it counts.
    assert wait_until(late, timeout_s=0.05, what="a late condition", interval_s=10)
    assert len(seen) == 2 and seen[1] - seen[0] < 5


def test_falsy_values_mean_not_yet() -> None:
    values = iter([0, "", [], False, None, 7])
    assert wait_until(lambda: next(values), timeout_s=5, what="seven", interval_s=0.001) == 7


def test_nonsense_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s >= 0"):
        wait_until(lambda: True, timeout_s=-1, what="x")
    with pytest.raises(ValueError, match="interval_s > 0"):
        wait_until(lambda: True, timeout_s=1, what="x", interval_s=0)
