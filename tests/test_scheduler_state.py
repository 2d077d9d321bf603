"""Each family names what its scheduler keeps between steps, and the pinned diffusers agrees:
the attributes a step changes are exactly those the family's checkpoints hold. A diffusers
upgrade that keeps more state (or renames it) fails here instead of breaking resume silently."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers_harness import make_spec
from workers.families import family_named
from workers.families.scheduler_state import SchedulerStateError

_ABSENT = object()


def _snapshot(scheduler: Any) -> dict[str, Any]:
    return {name: copy.deepcopy(value) for name, value in vars(scheduler).items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (type(a) is type(b) and a == b)


@pytest.mark.parametrize("family", ["wan", "qwen-image"])
def test_the_attributes_a_step_changes_are_those_a_checkpoint_holds(
        family: str, model_dir: Path, qwen_model_dir: Path) -> None:
    trajectory = family_named(family).trajectory(model_dir if family == "wan"
                                                 else qwen_model_dir)
    spec = make_spec(num_inference_steps=5)
    scheduler = trajectory.scheduler(spec)
    x = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    changed: set[str] = set()
    for i in range(spec.num_inference_steps):
        before = _snapshot(scheduler)
        x = scheduler.step(torch.tanh(x) * (i + 1), scheduler.timesteps[i], x,
                           return_dict=False)[0]
        after = _snapshot(scheduler)
        changed |= {name for name in before.keys() | after.keys()
                    if not _same(before.get(name, _ABSENT), after.get(name, _ABSENT))}
    assert changed == set(trajectory.scheduler_fields.names), (
        f"{type(scheduler).__name__} changed {sorted(changed)} as it stepped; the family's "
        f"checkpoints hold {sorted(trajectory.scheduler_fields.names)}")


def test_a_state_that_does_not_fit_the_scheduler_is_refused(qwen_model_dir: Path) -> None:
    trajectory = family_named("qwen-image").trajectory(qwen_model_dir)
    scheduler = trajectory.scheduler(make_spec(num_inference_steps=5))
    with pytest.raises(SchedulerStateError, match="model_outputs"):
        trajectory.scheduler_fields.restore(scheduler, {"model_outputs": [None]},
                                            torch.device("cpu"))
