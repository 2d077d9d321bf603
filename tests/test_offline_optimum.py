"""The offline optimum of ``bench.pressure``: its intervals, its LP bound against hand-solved
cases, and against every integral policy on small random logs (the bound must never be
below the best of them, and Belady's weighted MIN, one such policy, never above it)."""

from __future__ import annotations

import itertools
import random

import pytest

from bench.offline_optimum import (
    Interval,
    belady_s,
    costs_and_sizes,
    intervals,
    lp_bound_s,
    savings,
)
from cachesvc.lookup_log import Access, LoggedAccess
from keys import KeyKind, StoreKey

HIT, MISS, WRITE = Access.HIT, Access.MISS, Access.WRITE


def entry(name: str) -> str:
    return str(StoreKey("t", KeyKind.EMBEDDING, name))


def log_of(*accesses: tuple[Access, str, int, float]) -> list[LoggedAccess]:
    return [LoggedAccess(float(i), access, entry(name), size, cost)
            for i, (access, name, size, cost) in enumerate(accesses)]


def test_one_search_that_missed_several_alternatives_saves_at_most_one() -> None:
    # Two checkpoints of one chain, both written, then one search that found neither: an
    # ideal cache would have served it from one of them, not from both.
    log = [*log_of((WRITE, "step2", 1, 2.0), (WRITE, "step4", 1, 4.0)),
           LoggedAccess(2.0, MISS, entry("step2"), group="g"),
           LoggedAccess(2.0, MISS, entry("step4"), group="g")]
    measured = savings(log, 2)
    assert measured.bound_s == pytest.approx(4.0)
    assert measured.lookups == 1


def test_intervals_end_at_lookups_of_written_entries() -> None:
    log = log_of((MISS, "a", 0, 0), (WRITE, "a", 10, 2.0), (HIT, "a", 10, 2.0),
                 (WRITE, "a", 10, 9.0), (MISS, "a", 0, 0), (HIT, "never-written", 5, 1.0))
    # The rewrite saves nothing; the miss after it would have been a hit. The first write's
    # cost stands.
    assert intervals(log, costs_and_sizes(log)) == [Interval(1, 2, 10, 2.0),
                                                    Interval(3, 4, 10, 2.0)]


def test_nothing_is_kept_before_an_entry_is_first_written() -> None:
    # Two requests miss on an output before either makes it: no cache could have served the
    # second.
    log = log_of((MISS, "out", 0, 0), (MISS, "out", 0, 0), (WRITE, "out", 4, 3.0),
                 (HIT, "out", 4, 3.0))
    assert intervals(log, costs_and_sizes(log)) == [Interval(2, 3, 4, 3.0)]
    assert savings(log, 4).bound_s == pytest.approx(3.0)


def test_two_entries_that_cannot_both_be_kept_share_the_memory_fractionally() -> None:
    # a (2 bytes) and b (1 byte) overlap; with 2 bytes the LP keeps b and half of a.
    log = log_of((WRITE, "a", 2, 1.0), (WRITE, "b", 1, 1.0), (HIT, "a", 2, 1.0),
                 (HIT, "b", 1, 1.0))
    spans = intervals(log, costs_and_sizes(log))
    assert lp_bound_s(spans, len(log), 3) == pytest.approx(2.0)
    assert lp_bound_s(spans, len(log), 2) == pytest.approx(1.5)
    assert lp_bound_s(spans, len(log), 1) == pytest.approx(1.0)
    assert lp_bound_s(spans, len(log), 0) == pytest.approx(0.0)


def test_the_service_savings_are_its_hits_valued_as_given() -> None:
    log = log_of((WRITE, "a", 4, 1.0), (HIT, "a", 4, 1.0), (MISS, "a", 0, 0),
                 (WRITE, "a", 4, 1.5), (HIT, "a", 4, 1.5))
    measured = savings(log, 4)
    assert (measured.saved_s, measured.hits, measured.lookups) == (2.0, 2, 3)
    assert measured.bound_s == pytest.approx(3.0)  # the miss too, had it been kept
    assert measured.saved_by_kind == {KeyKind.EMBEDDING: 2.0}
    assert savings(log, 4, {entry("a"): (4, 0.5)}).saved_s == 1.0  # another run's costs


def best_integral(spans: list[Interval], length: int, capacity: int) -> float:
    """The most any policy saves: every set of intervals kept whole, within the memory."""
    best = 0.0
    for kept in itertools.product((False, True), repeat=len(spans)):
        held = [0] * length
        for span, keep in zip(spans, kept, strict=True):
            if keep:
                for t in range(span.start, span.end):
                    held[t] += span.size
        if max(held) <= capacity:
            best = max(best, sum(s.value_s for s, k in zip(spans, kept, strict=True) if k))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_bound_is_at_least_every_policy_and_at_most_every_interval(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {name: rng.randint(1, 4) for name in "abcd"}
    costs = {name: rng.choice([0.5, 1.0, 3.0]) for name in "abcd"}
    accesses: list[tuple[Access, str, int, float]] = []
    written: set[str] = set()
    for _ in range(12):
        name = rng.choice("abcd")
        access = HIT if name in written else WRITE
        written.add(name)
        accesses.append((access, name, sizes[name], costs[name]))
    log = log_of(*accesses)
    spans = intervals(log, costs_and_sizes(log))
    capacity = rng.randint(1, 6)
    bound = lp_bound_s(spans, len(log), capacity)
    best = best_integral(spans, len(log), capacity)
    assert bound >= best - 1e-9
    assert bound <= sum(s.value_s for s in spans) + 1e-9
    assert 0.0 <= belady_s(log, costs_and_sizes(log), capacity) <= best + 1e-9


@pytest.mark.parametrize("seed", range(40))
def test_belady_never_saves_more_than_the_bound(seed: int) -> None:
    # Misses, lookups before the first write, empty entries and searches with alternatives.
    rng = random.Random(seed)
    sizes = {name: rng.randint(0, 4) for name in "abcde"}
    costs = {name: rng.choice([0.0, 0.5, 1.0, 3.0]) for name in "abcde"}
    log: list[LoggedAccess] = []
    for n in range(16):
        names = rng.sample("abcde", rng.choice([1, 1, 2]))
        access = rng.choice([WRITE, HIT, MISS])
        group = f"g{n}" if len(names) > 1 and access is not WRITE else None
        log += [LoggedAccess(float(n), access, entry(name), sizes[name], costs[name],
                             group=group) for name in (names if group else names[:1])]
    known = costs_and_sizes(log)
    capacity = rng.randint(0, 8)
    saved = belady_s(log, known, capacity)
    assert 0.0 <= saved <= lp_bound_s(intervals(log, known), len(log), capacity) + 1e-9


def test_belady_keeps_what_is_worth_most_per_byte_until_its_next_lookup() -> None:
    # Room for one of a (2 bytes, 1 s) and b (1 byte, 1.2 s), both looked up again soon: b
    # is worth more a byte, so a makes room for it. c, never looked up again, is worth
    # nothing, however dear.
    log = log_of((WRITE, "a", 2, 1.0), (WRITE, "b", 1, 1.2), (WRITE, "c", 1, 5.0),
                 (HIT, "a", 2, 1.0), (HIT, "b", 1, 1.2))
    known = costs_and_sizes(log)
    assert belady_s(log, known, 2) == pytest.approx(1.2)
    assert belady_s(log, known, 3) == pytest.approx(2.2)
    assert belady_s(log, known, 0) == 0.0


def test_belady_saves_a_search_with_alternatives_once() -> None:
    log = [*log_of((WRITE, "step2", 1, 2.0), (WRITE, "step4", 1, 4.0)),
           LoggedAccess(2.0, HIT, entry("step2"), group="g"),
           LoggedAccess(2.0, HIT, entry("step4"), group="g")]
    assert belady_s(log, costs_and_sizes(log), 2) == pytest.approx(4.0)
