"""Where a diffusers transformer keeps its blocks and attention modules, what a block takes and
returns, and a call of either on some of its batch's rows. The one place the engine reads
diffusers' block registry and identifier patterns (private to diffusers 0.42; the tests pin
them, ``tests/test_row_caches.py``)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The arguments of a block or an attention module that hold one entry per row of the batch,
# by diffusers' names (any other argument is shared by every row: rotary embeddings, options).
ROW_ARGUMENTS = frozenset({"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                           "attention_mask", "temb"})


@dataclass(frozen=True, slots=True)
class BlockOutputs:
    """Where a block's output holds its hidden states and its text's (None: it returns its
    hidden states alone)."""

    hidden: int | None
    text: int | None

    def split(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(output, tuple):
            return output, None
        assert self.hidden is not None
        return output[self.hidden], None if self.text is None else output[self.text]

    def join(self, hidden: torch.Tensor, text: torch.Tensor | None) -> Any:
        if self.hidden is None or self.text is None:
            return hidden
        out: list[torch.Tensor | None] = [None] * (max(self.hidden, self.text) + 1)
        out[self.hidden], out[self.text] = hidden, text
        return tuple(out)


def blocks_of(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks, in order: those of its ModuleLists that diffusers' cache
    hooks take for blocks (the first is the head, the last the tail)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [block for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
            and isinstance(child, torch.nn.ModuleList) for block in child]


def outputs_of(block: torch.nn.Module) -> BlockOutputs:
    from diffusers.hooks._helpers import TransformerBlockRegistry

    metadata = TransformerBlockRegistry.get(type(block))
    return BlockOutputs(metadata.return_hidden_states_index,
                        metadata.return_encoder_hidden_states_index)


def attention_of(transformer: torch.nn.Module, patterns: Sequence[str] | None
                 ) -> list[tuple[str, torch.nn.Module]]:
    """The modules TaylorSeer forecasts: those whose names fully match ``patterns``, or
    diffusers' default attention patterns where none are given."""
    from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS

    chosen = tuple(patterns) if patterns else _TRANSFORMER_BLOCK_IDENTIFIERS
    return [(name, module) for name, module in transformer.named_modules()
            if any(re.fullmatch(p, name) for p in chosen)]


_PARAMETERS: dict[type, tuple[str, ...]] = {}


def _parameters(cls: type[torch.nn.Module]) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after ``self``, in order."""
    if cls not in _PARAMETERS:
        _PARAMETERS[cls] = tuple(list(inspect.signature(cls.forward).parameters)[1:])
    return _PARAMETERS[cls]


def argument(module: torch.nn.Module, name: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """The value of ``module.forward``'s argument ``name`` in a call."""
    if name in kwargs:
        return kwargs[name]
    index = _parameters(type(module)).index(name)
    return args[index] if index < len(args) else None


def on_rows(module: torch.nn.Module, call: Callable[..., Any], rows: torch.Tensor,
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``call`` (the module's own forward) on the rows ``rows`` of its batch: every argument
    that holds one entry per row (``ROW_ARGUMENTS``) taken at those rows."""
    names = _parameters(type(module))

    def taken(name: str, value: Any) -> Any:
        if name in ROW_ARGUMENTS and isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.index_select(0, rows.to(value.device))
        return value

    return call(*(taken(names[i], v) for i, v in enumerate(args)),
                **{k: taken(k, v) for k, v in kwargs.items()})
