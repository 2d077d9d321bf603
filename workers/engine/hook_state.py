"""A run's step-cache state (``row_caches``: per guidance branch, its policy's fields) as
checkpoint content: tensors for safetensors and a JSON tree for the rest, never pickle. A
state is a plain object of tensors, numbers, dtypes, devices and containers of them; anything
else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from keys import StepCache

# One hook state: its fields by name (what ``vars`` gives, less what each forward rewrites).
HookFields = dict[str, Any]
# One guidance branch of one run: each stateful hook's fields, in module order, or None for a
# hook that has not run yet.
BranchState = tuple[HookFields | None, ...]
# A run's hook state: by guidance branch ("cond", "uncond").
RunHookState = dict[str, BranchState]

Node = Any  # a JSON value
# The dtypes a hook state may name, by name: stored text never picks a torch attribute.
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(slots=True)
class CachedForward:
    """One row's forward under its run's step cache: the branch's state before it, and after
    it once it ran."""

    cache: StepCache
    steps: int  # the trajectory's step count, which MagCache's configuration holds
    before: BranchState
    after: BranchState | None = None
    skipped: bool = False  # a hook stood in for part of the forward


class HookStateError(ValueError):
    """A hook state holds a value that has no checkpoint form, or a stored tree is malformed."""


def encode(state: RunHookState, prefix: str) -> tuple[Node, dict[str, torch.Tensor]]:
    """``state`` as a JSON tree whose tensors are named ``prefix.N`` in the returned dict."""
    tensors: dict[str, torch.Tensor] = {}

    def node(value: Any, where: str) -> Node:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor):
            name = f"{prefix}.{len(tensors)}"
            tensors[name] = value.detach().to("cpu").contiguous()
            return {"tensor": name}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": value.type}
        if isinstance(value, torch.Size):
            return {"size": list(value)}
        if isinstance(value, tuple | list):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {"dict": [[k, node(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        raise HookStateError(f"hook state {where} is a {type(value).__name__}, which a "
                             "checkpoint cannot hold")

    tree = {branch: [None if fields is None
                     else {name: node(v, f"{branch}[{i}].{name}") for name, v in fields.items()}
                     for i, fields in enumerate(hooks)]
            for branch, hooks in state.items()}
    return tree, tensors


def decode(tree: Node, tensors: dict[str, torch.Tensor], device: torch.device) -> RunHookState:
    """The state ``encode`` wrote, its tensors and devices on ``device``."""

    def value(n: Node) -> Any:
        if n is None or isinstance(n, bool | int | float | str):
            return n
        if not isinstance(n, dict) or len(n) != 1:
            raise HookStateError(f"malformed hook state node {n!r}")
        (kind, v), = n.items()
        if kind == "tensor":
            return tensors[v].to(device)
        if kind == "dtype":
            if v not in _DTYPES:
                raise HookStateError(f"{v!r} is not a torch dtype a hook state holds")
            return _DTYPES[v]
        if kind == "device":
            return device
        if kind == "size":
            return torch.Size(v)
        if kind == "tuple":
            return tuple(value(x) for x in v)
        if kind == "list":
            return [value(x) for x in v]
        if kind == "dict":
            return {k: value(x) for k, x in v}
        raise HookStateError(f"unknown hook state node kind {kind!r}")

    try:
        return {branch: tuple(None if fields is None
                              else {name: value(n) for name, n in fields.items()}
                              for fields in hooks)
                for branch, hooks in tree.items()}
    except (KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise HookStateError(f"malformed hook state: {exc!r}") from exc


def on_device(state: RunHookState, device: torch.device) -> RunHookState:
    """``state`` with its tensors (and the devices it names) on ``device``."""

    def moved(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, torch.device):
            return device
        if isinstance(value, tuple | list) and not isinstance(value, torch.Size):
            return type(value)(moved(v) for v in value)
        if isinstance(value, dict):
            return {k: moved(v) for k, v in value.items()}
        return value

    return {branch: tuple(None if fields is None else {n: moved(v) for n, v in fields.items()}
                          for fields in hooks)
            for branch, hooks in state.items()}
