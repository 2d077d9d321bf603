"""The engine's choice between laying a step's rows out in two forwards on two threads or in
one: both are timed on the first steps of a geometry, alternately, then the faster is kept."""

from __future__ import annotations

from workers.engine.layout import TRIALS, ForwardLayouts, Layout


def test_both_layouts_are_timed_then_the_faster_per_row_is_kept() -> None:
    layouts = ForwardLayouts()
    seconds = {Layout.SPLIT: 0.090, Layout.WHOLE: 0.060}
    tried = []
    for _ in range(2 * TRIALS):
        layout = layouts.choose("shapes")
        tried.append(layout)
        layouts.observe("shapes", layout, 16, seconds[layout])
    assert sorted(tried, key=lambda la: la.value) == sorted(
        [Layout.SPLIT, Layout.WHOLE] * TRIALS, key=lambda la: la.value)
    assert tried[0] is not tried[1]  # alternating
    assert layouts.choose("shapes") is Layout.WHOLE
    # Per row: a split step of fewer rows is not taken for a faster one.
    other = ForwardLayouts()
    for _ in range(2 * TRIALS):
        layout = other.choose("wan")
        rows = 16 if layout is Layout.WHOLE else 8
        other.observe("wan", layout, rows, 0.080)
    assert other.choose("wan") is Layout.WHOLE
    # Each geometry has its own verdict; one not timed yet starts with a trial.
    assert other.choose("another") is Layout.SPLIT
