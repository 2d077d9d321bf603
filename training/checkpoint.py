"""A training run's checkpoint: weights, optimizer moments and the noise generator's state in
safetensors, the position in the run in JSON. Nothing is pickled, and a run resumed from it
takes bit for bit the steps an uninterrupted run takes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

TENSORS = "state.safetensors"
POSITION = "position.json"


@dataclass(frozen=True, slots=True)
class Position:
    """Where a run stands: the phase under way and the steps it has taken."""

    phase: str
    step: int
    extra: dict[str, Any]  # what a phase computed once and later phases read (JSON values)


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be read back."""


class PlanError(ValueError):
    """A training plan that cannot be run; the message names the field."""


class PlanMismatchError(PlanError):
    """A work folder holds a run of another plan: resuming it would mix two runs."""


def check_plan(plan: DataclassInstance, work: Path) -> None:
    """Record the plan in a new work folder; refuse one that holds another plan's run."""
    path = work / "plan.json"
    wanted = asdict(plan)
    if path.exists():
        found = json.loads(path.read_text())
        if found != wanted:
            changed = sorted(k for k in wanted if found.get(k) != wanted[k])
            raise PlanMismatchError(f"{work} holds a run with other {', '.join(changed)}; "
                                    "resume it with the same options or use another --work")
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=1))


def save(directory: Path, position: Position, modules: dict[str, torch.nn.Module],
         optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
    """Write the checkpoint beside the previous one, then swap it in, so a run killed while
    saving still finds the previous one whole."""
    tensors: dict[str, torch.Tensor] = {"generator": generator.get_state()}
    for name, module in modules.items():
        for key, value in module.state_dict().items():
            tensors[f"model/{name}/{key}"] = value.detach().contiguous()
    optimizer_state = optimizer.state_dict()
    for index, moments in optimizer_state["state"].items():
        for key, value in moments.items():
            tensors[f"optimizer/{index}/{key}"] = torch.as_tensor(value).contiguous()
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, partial / TENSORS)
    (partial / POSITION).write_text(json.dumps(
        {**asdict(position), "param_groups": optimizer_state["param_groups"]}, indent=1))
    previous = directory.with_name(directory.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if directory.exists():
        directory.rename(previous)
    partial.rename(directory)
    shutil.rmtree(previous, ignore_errors=True)


def read_position(directory: Path) -> Position | None:
    """The position a checkpoint holds; None when there is none."""
    path = directory / POSITION
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        return Position(phase=raw["phase"], step=int(raw["step"]), extra=raw["extra"])
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"{path}: not a training checkpoint ({error})") from error


def restore(directory: Path, modules: dict[str, torch.nn.Module],
            optimizer: torch.optim.Optimizer | None, generator: torch.Generator) -> None:
    """Load weights (all ``modules``), the generator and, where given, the optimizer."""
    tensors = load_file(directory / TENSORS)
    generator.set_state(tensors["generator"])
    for name, module in modules.items():
        prefix = f"model/{name}/"
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items()
                                if k.startswith(prefix)})
    if optimizer is None:
        return
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            moments.setdefault(int(index), {})[name] = value
    groups = json.loads((directory / POSITION).read_text())["param_groups"]
    optimizer.load_state_dict({"state": moments, "param_groups": groups})
