"""The engine's scheduler from states alone, with no Redis, store or model: who joins, who makes
way, and which rows share which forward (rows of every adapter set and step sharing one, rows a
step cache stands in for riding along)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from keys import GenerationSpec, OutputFormat, StepCache, StepCachePolicy
from workers.engine.guidance import Row
from workers.engine.layout import Layout
from workers.engine.row_caches import RunStepCache
from workers.engine.scheduler import Limits, RowNeed, RunView, Scheduler

NONE: frozenset[str] = frozenset()


def need(run: int, row: int = 0, group: Hashable = "g", text: int = 8, image: int = 16,
         adapters: frozenset[str] = NONE) -> RowNeed:
    return RowNeed((run, row), group, "geometry", image, text, adapters)


def any_size(_: Hashable, most: int) -> int:
    return most


def test_runs_join_while_there_is_room_and_their_adapters_fit() -> None:
    scheduler = Scheduler(Limits(max_batch=4, max_tokens=1 << 16, adapters=2))
    held = [RunView(frozenset({"a"})), RunView(NONE)]
    waiting = [RunView(frozenset({"b", "c"})),  # three adapters with the engine's: waits
               RunView(frozenset({"b"})), RunView(NONE), RunView(NONE)]
    assert scheduler.admit(held, waiting) == [1, 2]  # the room is two
    assert scheduler.admit([], [RunView(frozenset({"x", "y", "z"}))]) == []  # never fits
    assert scheduler.admit(held, []) == []


def test_the_last_preemptible_run_makes_way() -> None:
    held = [RunView(NONE, preemptible=True), RunView(NONE, preemptible=True),
            RunView(NONE, preemptible=False)]
    scheduler = Scheduler(Limits(max_batch=3, max_tokens=1 << 16, adapters=4))
    assert scheduler.make_way(held) == 1
    assert scheduler.make_way([RunView(NONE)]) is None
    # One that leaving would not make room for: a run whose step cache skipped weighs nothing.
    skipping = [RunView(NONE, preemptible=True), RunView(NONE, preemptible=True),
                RunView(NONE, preemptible=True, weight=0.0), RunView(NONE, weight=1.0)]
    assert scheduler.room(skipping) == 0 and scheduler.make_way(skipping) == 1


def test_rows_of_any_adapter_set_and_step_share_a_forward() -> None:
    scheduler = Scheduler(Limits(max_batch=8, max_tokens=1 << 16, adapters=4))
    rows = [need(0, 0, adapters=frozenset({"a"})), need(0, 1, adapters=frozenset({"a"})),
            need(1, 0), need(2, 0, adapters=frozenset({"b", "c"}), text=3),
            need(3, 0, group="other")]
    planned = scheduler.forwards(rows, lambda _: Layout.SPLIT, any_size)
    # One forward of the group, the shortest text first; the other group apart.
    assert [f.slots for f in planned] == [((2, 0), (0, 0), (0, 1), (1, 0)), ((3, 0),)]


def test_forwards_are_cut_by_tokens_refused_sizes_and_adapters() -> None:
    scheduler = Scheduler(Limits(max_batch=4, max_tokens=100, adapters=2))
    rows = [need(n, text=9, image=16) for n in range(8)]  # 25 token-rows each: 4 fit
    assert [len(f.slots) for f in scheduler.forwards(rows, lambda _: Layout.SPLIT,
                                                     any_size)] == [4, 4]
    # The proof refused batches of 4: forwards of 3.
    cut = scheduler.forwards(rows, lambda _: Layout.SPLIT,
                             lambda _, most: 3 if most >= 4 else most)
    assert [len(f.slots) for f in cut] == [3, 3, 2]
    # A forward carries at most two adapters: a third starts another.
    adapted = [need(n, adapters=frozenset({name}), image=1, text=1)
               for n, name in enumerate("aabc")]
    assert [f.slots for f in scheduler.forwards(adapted, lambda _: Layout.SPLIT,
                                                any_size)] == [((0, 0), (1, 0), (2, 0)),
                                                               ((3, 0),)]


def test_the_layout_decides_only_where_it_cuts_otherwise() -> None:
    scheduler = Scheduler(Limits(max_batch=2, max_tokens=1 << 16, adapters=4))
    asked: list[Hashable] = []

    def layout(geometry: Hashable) -> Layout:
        asked.append(geometry)
        return Layout.WHOLE

    two = scheduler.forwards([need(0), need(1)], layout, any_size)
    assert asked == [] and two[0].layout is None  # two rows: one forward either way
    four = scheduler.forwards([need(n) for n in range(4)], layout, any_size)
    assert asked == ["geometry"] and [len(f.slots) for f in four] == [4]


def test_runs_whose_rows_a_step_cache_stands_in_for_leave_room_to_join() -> None:
    scheduler = Scheduler(Limits(max_batch=4, max_tokens=1 << 16, adapters=4))
    computing = [RunView(NONE) for _ in range(4)]
    assert scheduler.room(computing) == 0
    # Four runs whose last steps computed half their rows weigh two: two more join.
    halves = [RunView(NONE, weight=0.5) for _ in range(4)]
    assert scheduler.room(halves) == 2
    assert scheduler.admit(halves, [RunView(NONE)] * 3) == [0, 1]
    # Runs that skipped everything still fill the engine at twice max_batch.
    skipping = [RunView(NONE, weight=0.0) for _ in range(7)]
    assert scheduler.room(skipping) == 1


def test_rows_stood_in_for_ride_along_in_a_forward() -> None:
    scheduler = Scheduler(Limits(max_batch=4, max_tokens=1 << 16, adapters=4))
    # Eight rows each expected to cost half a row: one forward of eight, not two of four.
    halves = [need(n, image=1, text=1) for n in range(8)]
    light = [RowNeed(r.slot, r.group, r.geometry, r.image_tokens, r.text_tokens, r.adapters,
                     0.5) for r in halves]
    assert [len(f.slots) for f in scheduler.forwards(light, lambda _: Layout.SPLIT,
                                                     any_size)] == [8]
    # Never more than twice the bound's rows, however light.
    free = [RowNeed((n, 0), "g", "geometry", 1, 1, NONE, 0.0) for n in range(20)]
    assert [len(f.slots) for f in scheduler.forwards(free, lambda _: Layout.SPLIT,
                                                     any_size)] == [8, 8, 4]
    # No forward of a size the proof refused, computed rows or riding along.
    refuses_4 = lambda _, most: 3 if most == 4 else most  # noqa: E731
    whole_rows = [need(n, image=1, text=1) for n in range(8)]
    assert [len(f.slots) for f in scheduler.forwards(whole_rows, lambda _: Layout.SPLIT,
                                                     refuses_4)] == [3, 3, 2]
    refuses_8 = lambda _, most: 7 if most == 8 else most  # noqa: E731
    assert [len(f.slots) for f in scheduler.forwards(light, lambda _: Layout.SPLIT,
                                                     refuses_8)] == [7, 1]
    # Many light rows cut otherwise in one forward than in several: the layout is asked.
    asked: list[Hashable] = []
    scheduler.forwards(free, lambda g: asked.append(g) or Layout.WHOLE, any_size)
    assert asked == ["geometry"]
    # The token budget bounds the rows that ride along as it bounds the others.
    tight = Scheduler(Limits(max_batch=4, max_tokens=10, adapters=4))
    assert [len(f.slots) for f in tight.forwards(free[:8], lambda _: Layout.SPLIT,
                                                  any_size)] == [5, 3]


def test_a_runs_weight_is_the_share_of_its_last_steps_rows_computed() -> None:
    spec = GenerationSpec.create(request_id="r", tenant="t", prompt="p", width=32, height=32,
                                 num_frames=1, num_inference_steps=4, guidance_scale=4.0,
                                 seed=0, output_format=OutputFormat.NPY)
    run = RunStepCache(StepCache.create(StepCachePolicy.FIRST_BLOCK), steps=4)
    assert run.computed_share == 1.0  # before its first step
    for skipped, share in (((True, False), 0.5), ((True, True), 0.0), ((False, False), 1.0)):
        rows = run.attach([Row(torch.zeros(1), torch.tensor(1.0), torch.zeros(1, 1, 1), spec)
                           for _ in skipped])
        for row, skip in zip(rows, skipped, strict=True):
            assert row.cached is not None
            row.cached.after, row.cached.skipped = (), skip
        run.commit(rows)
        assert run.computed_share == share
    assert (run.forwards, run.skipped) == (6, 3)
    # A TaylorSeer row that forecasts runs every block but its attention: a whole row.
    forecasting = RunStepCache(StepCache.create(StepCachePolicy.TAYLORSEER), steps=4)
    rows = forecasting.attach([Row(torch.zeros(1), torch.tensor(1.0), torch.zeros(1, 1, 1),
                                   spec)])
    assert rows[0].cached is not None
    rows[0].cached.after, rows[0].cached.skipped = (), True
    forecasting.commit(rows)
    assert forecasting.computed_share == 1.0 and forecasting.skipped == 1
