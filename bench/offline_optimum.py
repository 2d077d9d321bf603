"""What an ideal cost-aware cache with a given memory could have saved on a lookup log
(``cachesvc.lookup_log``), and what the cache that wrote the log did save.

The bound is the linear-programming relaxation of offline caching with sizes and costs (the
interval LP behind FOO, Berger, Beckmann and Harchol-Balter, SIGMETRICS 2018): between two
consecutive accesses to an entry, a fraction x of it may be kept, each kept interval saves
x times the entry's cost at its second access if that is a lookup, and at no moment may the
kept bytes exceed the memory. A search that missed several entries, any one of which would
have served it (a chain's checkpoints), saves at most one of them: their fractions add up to
at most 1. Every real policy (Belady's MIN weighted by cost per byte included) is one integral
solution, so the bound is at least the true optimum for the log's sequence of lookups, and a
ratio to it understates the ratio to the optimum. scipy's HiGHS solves it; as a flow along the
log's timeline it has two non-zeros per variable, so a log of 10^5 accesses solves in seconds.

From below, ``belady_s`` runs one such integral policy that knows the future: Belady's MIN
weighted by cost per byte. On the same log, the true optimum lies between the two.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachesvc.lookup_log import Access, LoggedAccess
from keys import KeyKind, StoreKey


@dataclass(frozen=True, slots=True)
class Interval:
    """An entry's bytes between two accesses: keeping them saves ``value_s`` at ``end``."""

    start: int  # positions in the log
    end: int
    size: int
    value_s: float
    group: str | None = None  # the search its end was part of, if it had alternatives


# An entry's bytes and the compute seconds it saves, by key.
Known = dict[str, tuple[int, float]]


@dataclass(frozen=True, slots=True)
class LogSavings:
    """What the log shows: the seconds its hits saved, the bound, and the parts of both."""

    saved_s: float  # the hits' costs, as the entries' writes recorded them
    bound_s: float  # the LP bound at the memory given
    hits: int
    lookups: int
    written_bytes: int  # the bytes of every entry written, each counted once
    saved_by_kind: dict[KeyKind, float]


def costs_and_sizes(log: Sequence[LoggedAccess]) -> Known:
    """Each written entry's bytes and cost, as its first write recorded them."""
    known: Known = {}
    for access in log:
        if access.access is Access.WRITE:
            known.setdefault(access.key, (access.size, access.cost_s))
    return known


def intervals(log: Sequence[LoggedAccess], known: Known) -> list[Interval]:
    """The intervals worth keeping: between consecutive accesses to an entry from its first
    write on (before it, there is nothing to keep: two requests that miss on an output not
    yet made could not have shared it), ending at a lookup (a rewrite saves nothing)."""
    last: dict[str, int] = {}
    written: set[str] = set()
    out = []
    for position, access in enumerate(log):
        start = last.get(access.key)
        last[access.key] = position
        existed = access.key in written  # then written at or before ``start``
        if access.access is Access.WRITE:
            written.add(access.key)
            continue
        if start is None or not existed or access.key not in known:
            continue
        size, cost_s = known[access.key]
        if cost_s > 0:
            out.append(Interval(start, position, size, cost_s, access.group))
    return out


def lp_bound_s(spans: Sequence[Interval], length: int, capacity_bytes: int) -> float:
    """The LP bound: the most seconds any fraction of ``spans`` kept within
    ``capacity_bytes`` at every position saves.

    Variables: x_i in [0, 1] per interval, then f_t in [0, capacity] per position (the bytes
    kept just after position t). Constraints, one per position: f_t - f_{t-1} = bytes that
    begin being kept at t - bytes that stop at t; and one per search with alternatives: the
    sum of their x_i is at most 1.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    if not spans:
        return 0.0
    n, unit = len(spans), float(1 << 20)  # MiB keep the coefficients near 1
    rows, cols, vals = [], [], []
    for i, span in enumerate(spans):
        rows += [span.start, span.end]
        cols += [i, i]
        vals += [-span.size / unit, span.size / unit]
    for t in range(length):
        rows.append(t)
        cols.append(n + t)
        vals.append(1.0)
        if t:
            rows.append(t)
            cols.append(n + t - 1)
            vals.append(-1.0)
    equalities = coo_matrix((vals, (rows, cols)), shape=(length, n + length)).tocsr()
    groups: dict[str, list[int]] = defaultdict(list)
    for i, span in enumerate(spans):
        if span.group is not None:
            groups[span.group].append(i)
    alternatives = [members for members in groups.values() if len(members) > 1]
    at_most_one = None
    if alternatives:
        at_most_one = coo_matrix(
            ([1.0] * sum(map(len, alternatives)),
             ([r for r, members in enumerate(alternatives) for _ in members],
              [i for members in alternatives for i in members])),
            shape=(len(alternatives), n + length)).tocsr()
    objective = np.concatenate([[-s.value_s for s in spans], np.zeros(length)])
    bounds = [(0.0, 1.0)] * n + [(0.0, capacity_bytes / unit)] * length
    result = linprog(objective, A_ub=at_most_one,
                     b_ub=np.ones(len(alternatives)) if alternatives else None,
                     A_eq=equalities, b_eq=np.zeros(length), bounds=bounds, method="highs")
    if not result.success:
        raise RuntimeError(f"the offline bound did not solve: {result.message}")
    return float(-result.fun)


def _next_lookups(log: Sequence[LoggedAccess]) -> list[int | None]:
    """For each position, where the same entry is next looked up (None: never again)."""
    upcoming: list[int | None] = [None] * len(log)
    later: dict[str, int] = {}
    for position in range(len(log) - 1, -1, -1):
        access = log[position]
        upcoming[position] = later.get(access.key)
        if access.access is not Access.WRITE:
            later[access.key] = position
    return upcoming


class _Kept:
    """The entries Belady's weighted MIN keeps, each with the position of its next lookup."""

    def __init__(self, known: Known, capacity_bytes: int) -> None:
        self.known = known
        self.capacity = capacity_bytes
        self.following: dict[str, int | None] = {}
        self.used = 0

    def worth(self, key: str, now: int, following: int | None) -> float:
        size, cost_s = self.known[key]
        return 0.0 if following is None else cost_s / (max(size, 1) * (following - now))

    def offer(self, key: str, now: int, following: int | None) -> None:
        """Keep ``key`` until ``following`` if room can be made for it by dropping only
        entries worth less."""
        if key in self.following:
            self.following[key] = following
            return
        mine, size = self.worth(key, now, following), self.known[key][0]
        if mine <= 0.0 or size > self.capacity:
            return
        drop, room = [], self.capacity - self.used
        if room < size:
            for worth, other in sorted((self.worth(k, now, f), k)
                                       for k, f in self.following.items()):
                if room >= size or worth >= mine:
                    break
                drop.append(other)
                room += self.known[other][0]
        if room < size:
            return
        for other in drop:
            del self.following[other]
            self.used -= self.known[other][0]
        self.following[key] = following
        self.used += size


def belady_s(log: Sequence[LoggedAccess], known: Known, capacity_bytes: int) -> float:
    """The seconds an offline policy saves on ``log`` within ``capacity_bytes``: after any
    access to a written entry it keeps the entry if it can make room by dropping only entries
    of lower worth, the worth being cost / (bytes x log positions until its next lookup); an
    entry never looked up again is worth nothing. A lookup of a kept entry saves its cost; a
    search with alternatives saves the most any one of them does, once. What it keeps fits
    the memory at every position, so it saves no more than the best integral solution of the
    LP (it may keep two alternatives of one search, but is credited one)."""
    upcoming = _next_lookups(log)
    kept = _Kept(known, capacity_bytes)
    saved = 0.0
    served: dict[str, float] = {}  # a search's best saving so far, by its group
    written: set[str] = set()
    for now, access in enumerate(log):
        key = access.key
        if access.access is Access.WRITE:
            written.add(key)
        elif key in kept.following:
            gain = known[key][1]
            if access.group is None:
                saved += gain
            else:  # only what it adds to the best alternative found so far
                before = served.get(access.group, 0.0)
                saved += max(0.0, gain - before)
                served[access.group] = max(gain, before)
        if key in written and key in known:
            kept.offer(key, now, upcoming[now])
    return saved


def savings(log: Sequence[LoggedAccess], capacity_bytes: int,
            costs: Known | None = None) -> LogSavings:
    """What the cache that wrote ``log`` saved, and the bound at ``capacity_bytes``. Entries
    are valued as ``costs`` recorded them where it knows them (one run's timings for several
    runs, so that their noise does not tell them apart), else as ``log`` did."""
    written = costs_and_sizes(log)
    known = written | (costs or {})
    by_kind: dict[KeyKind, float] = defaultdict(float)
    hits = 0
    for access in log:
        if access.access is Access.HIT:
            hits += 1
            by_kind[StoreKey.parse(access.key).kind] += (
                known[access.key][1] if access.key in known else access.cost_s)
    # A search that missed several alternatives is one lookup.
    searches = {a.group or id(a) for a in log if a.access is not Access.WRITE}
    return LogSavings(sum(by_kind.values()),
                      lp_bound_s(intervals(log, known), len(log), capacity_bytes), hits,
                      len(searches), sum(size for size, _ in written.values()), dict(by_kind))
